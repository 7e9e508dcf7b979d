"""`echospec bench` and `echospec demo`: thin layers over echospec.tools.bench.bench and .demo."""

from __future__ import annotations

import click

from ...retriever.tree import MAX_DEPTH
from ..bench.harness import POLICIES
from ..commands import (OldSpellings, audio_options, device_option, dtype_option, fail_cleanly, knob_options,
                        limit_option, needs_extra, out_option, scoring, threads_option)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None


full_option = click.option("--full", is_flag=True, help="Print the full table (every column; bench.md always has it).")


@click.command("bench")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.option("--store", required=True, type=click.Path(exists=True, file_okay=False), help="Datastore directory.")
@click.option("--prompts", required=True, type=click.Path(exists=True, dir_okay=False),
              help="JSONL: input_ids (or inputs_embeds: a .pt/.npy file, with prompt_speech), or text + speaker for "
                   "an echospec TTS checkpoint; speaker and reference_tokens optional.")
@click.option("--speech-offset", type=int, show_default="the store's", help="Model id of speech id 0 (as for build).")
@click.option("--vocab-size", type=int, show_default="the store's", help="Number of speech ids (as for build).")
@click.option("--stop-id", "stop_ids", multiple=True, type=int, show_default="the store's, else the model's eos",
              help="Model id that ends speech (repeatable).")
@click.option("--token-rate", type=click.FloatRange(min=0, min_open=True), show_default="the checkpoint's, else 25",
              help="Speech tokens per second of audio, for the LM real-time factor.")
@click.option("--tokenizer", type=click.Path(exists=True, dir_okay=False), help="tokenizer.npz for log-mel distortion.")
@click.option("--policy", "policies", multiple=True, type=click.Choice(POLICIES), show_default="all",
              help="Policy to benchmark (repeatable).")
@click.option("--sampler", default="ras", show_default=True,
              help="What the sampling policies and their baseline sample with: a model's own rule by preset name "
                   "(ras, cosyvoice, cosyvoice-vllm, llasa, orpheus, spark-tts, outetts; "
                   "echospec.decoder.presets.SAMPLERS).")
@click.option("--stores", default="speaker,general", show_default=True, help="Which stores: speaker, general.")
@click.option("--max-nodes", "--nodes", "max_nodes", cls=OldSpellings,
              show_default="8, generate's: echospec.decoder.NODES",
              help="Most tree nodes a step verifies: an integer (0: plain steps), or 'auto' (AdaptiveBudget: the "
                   "fastest cap as measured).")
@click.option("--max-depth", "--depth", "max_depth", cls=OldSpellings, default=MAX_DEPTH, show_default=True,
              type=click.IntRange(1, 64), help="Deepest path of a proposed tree, in tokens.")
@click.option("--sweep-nodes", default="", help="Node budgets to sweep, e.g. 4,32,64.")
@click.option("--sweep-depths", default="", show_default="--max-depth", help="Depths to sweep, e.g. 4,12.")
@click.option("--sweep-policy", "sweep_policies", multiple=True, type=click.Choice(POLICIES),
              show_default="exact-sampling if benchmarked, else the first policy",
              help="Policy the sweeps run (repeatable).")
@limit_option()
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(1),
              help="Decode every prompt this many times (a fresh seed each): more utterances, narrower intervals.")
@click.option("--max-new-tokens", default=400, show_default=True, type=click.IntRange(1),
              help="Longest utterance, in speech tokens.")
@threads_option
@click.option("--seed", default=0, show_default=True, type=int,
              help="Seed of the first utterance; each decodes with this plus its index.")
@dtype_option(help="Precision every system runs in (log-likelihoods are scored in float32).")
@device_option()
@knob_options
@click.option("--sweep", "sweeps", multiple=True, metavar="KNOB=V1,V2,...",
              help="A relaxed policy's knob to sweep for the speed-quality frontier (repeatable): tau (filtered), "
                   "beta (tolerance), threshold (similarity, pcg); writes frontier.md/.json/.png and the chosen "
                   "settings to relaxed_settings.json (synthesize --settings, load_relaxed_settings).")
@audio_options
@out_option("runs/bench")
@full_option
@needs_extra("bench")
@fail_cleanly
def bench_command(checkpoint, store, prompts, speech_offset, vocab_size, stop_ids, token_rate, tokenizer, policies,
                  sampler, stores, max_nodes, max_depth, sweep_nodes, sweep_depths, sweep_policies, limit, rounds,
                  max_new_tokens, threads, seed, dtype, device, tau, beta, threshold, sweeps, audio_dir, audio_scores,
                  vocoder, asr, speaker_encoder, mos, scoring_workers, out_dir, full):
    """Compare autoregressive, HF prompt lookup and echospec's policies on CHECKPOINT: an echospec TTS
    checkpoint or any Hugging Face causal LM folder (a model with its own speech head: the Python API,
    echospec.tools.bench.bench(BenchSpec(Inputs(..., head=...)))).

    \b
    echospec bench tools/sample/model --store runs/demo/store --prompts tools/sample/prompts.jsonl \\
        --tokenizer tools/sample/tokenizer.npz --limit 20 --sweep-nodes 4,32
    echospec bench ./Llasa-1B --store llasa --prompts prompts.jsonl \\
        --speech-offset 128264 --vocab-size 65536 --stop-id 128261
    """
    from ..bench import BenchSpec, Inputs, bench, format_table
    from ..bench.frontier import parse_sweep
    from ..bench.harness import RelaxedSettings

    try:
        sweeps = dict(parse_sweep(text) for text in sweeps)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--sweep") from None
    scored = scoring(tokenizer, audio_dir, audio_scores, vocoder, asr, speaker_encoder, mos, scoring_workers)
    stores = tuple(s.strip() for s in stores.split(",") if s.strip())
    if not stores or set(stores) - {"speaker", "general"}:
        raise click.BadParameter("use speaker and/or general", param_hint="--stores")
    if max_nodes not in (None, "auto") and not max_nodes.isdigit():
        raise click.BadParameter(f"{max_nodes!r}: a non-negative integer (0: no tree) or 'auto'",
                                 param_hint="--max-nodes")
    inputs = Inputs(checkpoint, store, prompts, limit, speech_offset=speech_offset, vocab_size=vocab_size,
                    stop_ids=stop_ids, token_rate=token_rate, threads=threads, device=device, dtype=dtype)
    spec = BenchSpec(inputs, policies=policies or POLICIES, stores=stores, sampler=sampler,
                     relaxed=RelaxedSettings(tau, beta, threshold),
                     max_nodes=max_nodes if max_nodes in (None, "auto") else int(max_nodes), max_depth=max_depth,
                     sweep_nodes=_ints(sweep_nodes), sweep_depths=_ints(sweep_depths), sweep_policies=sweep_policies,
                     sweeps=sweeps, rounds=rounds, max_new_tokens=max_new_tokens, seed=seed, scoring=scored,
                     out_dir=out_dir)
    report = bench(spec)
    click.echo(format_table(report, full=full))
    click.echo(f"\nWrote {out_dir}/bench.json, bench.md (the full table) and bench.png"
               + (", frontier.md, frontier.json, frontier.png and relaxed_settings.json" if sweeps else "")
               + (f"; the WAVs under {audio_dir}" if audio_dir else ""))


@click.command("demo")
@out_option("runs/demo")
@limit_option(10, help="Held-out sentences to synthesize.")
@threads_option
@dtype_option(help="bfloat16 where the CPU computes it natively (AVX512-BF16, AMX); else it is emulated, slowly.")
@full_option
@click.option("--audio/--no-audio", default=True, show_default=True,
              help="Vocode every utterance, score WER, SIM and MOS, and write listen.html (the quality extra).")
@needs_extra("bench")
@fail_cleanly
def demo_command(out_dir, limit, threads, dtype, full, audio):
    """The embedded default: build stores from the shipped sample, query, benchmark every policy, and write the
    audio with a page to listen to it."""
    from ..bench import demo

    demo(out_dir=out_dir, limit=limit, threads=threads, dtype=dtype, full=full, echo=click.echo, audio=audio)


COMMANDS = (bench_command, demo_command)
