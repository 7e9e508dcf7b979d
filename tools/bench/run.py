"""`bench`: autoregressive, HF prompt lookup and echospec's policies side by side on one model and store.

Every system decodes every prompt; the order of systems changes from prompt to prompt (`balanced_order`)
so drift on a noisy machine hits all of them alike. Speed is reported as the ratio of median time per
token to the system's baseline (greedy systems: HF `generate`; sampling systems: autoregressive sampling
with the same sampler); quality as the target's mean log-likelihood of what was generated and, where the
tokenizer is known, the log-mel DTW distortion against the reference utterance, each with a 95%
bootstrap interval over utterances.

    bench       load (load.py), build the systems, decode every prompt with each, report (report.py)
    systems     the systems a bench compares, each with its baseline
    decode      every utterance with every system: the rows the report summarises
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np

from ...retriever.tree import MAX_DEPTH
from ..audio.scorers import Setup
from ..audio import quality_missing
from .audio import score_audio
from .divergence import divergence
from .frontier import frontier, swept_settings
from .harness import (
    POLICIES,
    BenchError,
    ForwardCounter,
    Prompt,
    System,
    balanced_order,
    echospec_run,
    hf_generate_run,
    make_policy,
    measure_cost_curve,
    warm_up,
)
from .load import DecodeInputs, decode_inputs, native_bfloat16
from .machine import machine
from .quality import dtw_distance
from .report import auto_against_fixed, summarise, write_report

DIVERGENCE_LOGITS = 20  # per system, the divergent utterances whose logits are compared (each replays its output)


def bench(checkpoint, store, prompts, *, speech=None, speech_offset: int | None = None, vocab_size: int | None = None,
          stop_ids=(), head=None, speech_embedding=None, sampler=None, token_rate: float | None = None,
          tokenizer=None, policies=POLICIES, stores=("speaker", "general"), max_nodes: int | str | None = None,
          max_depth: int = MAX_DEPTH, sweep_nodes=(), sweep_depths=(), sweep_policies=(),
          limit: int | None = None, rounds: int = 1, max_new_tokens: int = 400, threads: int = 1, seed: int = 0,
          tau: int | None = None, beta: float | None = None, similarity: float | None = None, device: str = "cpu",
          dtype: str = "float32", out_dir=None, progress: bool = True, sweeps=None, audio_scores: bool | None = None,
          vocoder=None, asr=None, speaker_encoder=None, mos=None, audio_dir=None, scoring_workers: int = 2) -> dict:
    """Decode `prompts` with every system; return (and write to `out_dir`) the report as a dict.

    `checkpoint`: an echospec TTS checkpoint folder, any Hugging Face causal LM folder, or (from Python) a
    loaded model — with `head` and `speech_embedding` for a model with its own speech head and table, as
    `generate` takes them (CosyVoice: `llm.llm.model`, head=llm.llm_decoder, speech_embedding=llm.speech_embedding).
    Speech ids: `speech` (a SpeechVocab, e.g. a preset's), else `speech_offset`, `vocab_size`, `stop_ids`
    (the build's names), else the checkpoint's or the store's. `prompts`: see `load.load_prompts`. `sampler`
    (a Sampler or RAS, or a name in `echospec.decoder.presets.SAMPLERS`: a model's own rule; default RAS) is
    what the sampling policies and their baseline sample with, recorded in the report's
    setup["sampler"]; `token_rate` (speech tokens
    a second, default the checkpoint's or 25) scales the LM real-time factor. Hugging Face `generate` is the
    greedy baseline where it can run the model (no head, ids prompts); else echospec's own autoregressive loop.
    Every prompt is decoded `rounds` times, each utterance with its own seed (`seed` + its index).
    `max_nodes` is every system's node budget but the sweeps': a cap, "auto" (an AdaptiveBudget per system), or
    None for `generate`'s own default, a fixed cap of `echospec.decoder.NODES`.

    `device` and `dtype` ("float32", "bfloat16", "float16") are where and in what precision every system
    runs; the log-likelihood is then scored by a float32 copy of the model, so every dtype is judged on one
    scale. For each utterance where a lossless system's tokens differ from its baseline's, the report
    gives the first divergent position and the largest logit difference there between the system's forward
    and a plain one-token forward (`divergences`): rounding (tiny differences at a near-tie) or a bug.

    Scores on audio (`audio_scores`; None: where a vocoder is at hand, `vocoder` or the `tokenizer`'s stand-in,
    and the quality extra is installed): every utterance and each prompt's reference through `vocoder`, scored
    for WER (`asr`), SIM (`speaker_encoder`) and MOS (`mos`) in `scoring_workers` processes after decoding
    (echospec.tools.audio.scorers); `audio_dir` keeps the WAVs as audio_dir/<system>/<prompt id>.wav.
    `sweeps` ({"tau": (10, 20), "beta": ..., "threshold": ...}) adds one system per setting of the policies each
    knob sets (frontier.KNOBS) on the first store, and the frontier (frontier.json, .md, .png) to `out_dir`.
    """
    import torch

    from ...decoder.budget import CAPS, NODES

    max_nodes = NODES if max_nodes is None else max_nodes
    sweeps = dict(sweeps or {})
    sampler_name, sampler = _sampler(sampler)
    unknown = set(sweep_policies) - set(policies)
    if unknown:
        raise BenchError(f"sweep policies {', '.join(sorted(unknown))} are not among the benchmarked policies")
    inputs = decode_inputs(checkpoint, store, prompts, limit, threads, device, dtype, speech=speech,
                           speech_offset=speech_offset, vocab_size=vocab_size, stop_ids=stop_ids, tau=tau, beta=beta,
                           similarity=similarity, with_scorer=True)
    attach = {"head": head, "speech_embedding": speech_embedding}
    hf_baselines = (head is None and speech_embedding is None
                    and all(p.input_ids is not None for p in inputs.prompts))
    compared = systems(inputs, list(policies), list(stores), sweep_nodes, sweep_depths or (max_depth,),
                       list(sweep_policies), max_nodes, max_depth, max_new_tokens, hf_baselines, sampler, attach,
                       sweeps)

    warm_up(compared, inputs.prompts[0], seed)
    largest = max(max(CAPS) if n == "auto" else int(n) for n in [max_nodes, *sweep_nodes])
    curve, curve_context = verify_cost_curve(inputs.model, inputs.speech, inputs.prompts, largest, **attach)
    rows, budgets = decode(compared, inputs, curve, rounds=rounds, seed=seed, tokenizer=tokenizer, attach=attach,
                           progress=progress)
    meta = inputs.meta
    rate = meta.frame_rate if meta is not None and token_rate is None else (token_rate or 25.0)
    report = summarise(compared, rows, token_rate=rate)
    report["machine"] = machine(threads=threads, device=device, dtype=dtype,
                                cpu_capability=torch.backends.cpu.get_cpu_capability(),
                                native_bfloat16=native_bfloat16(device))
    report["verify_cost_curve"] = curve.to_dict() | {"context_tokens": curve_context}
    report["auto_budgets"] = {name: state for name, state in budgets.items() if state}  # each cap's rate, at the end
    report["auto_against_fixed"] = auto_against_fixed(rows)
    speech = inputs.speech
    report["setup"] = {"checkpoint": (str(checkpoint) if isinstance(checkpoint, (str, Path))
                                      else type(inputs.model).__name__),
                       "store": str(store), "prompts": str(prompts) if isinstance(prompts, (str, Path)) else "python",
                       "utterances": rounds * len(inputs.prompts), "rounds": rounds, "max_nodes": max_nodes,
                       "max_depth": max_depth, "seed": seed,
                       "device": device, "dtype": dtype,
                       "speech": {"offset": speech.offset, "size": speech.size, "stop_ids": list(speech.stop_ids),
                                  "codebooks": speech.codebooks},
                       "relaxed": asdict(inputs.relaxed),
                       "sampler": {"preset": sampler_name, "rule": repr(sampler)}, "sweeps": sweeps}
    if audio_scores is None:
        audio_scores = (vocoder is not None or tokenizer is not None) and quality_missing() is None
    if audio_scores or audio_dir is not None:
        setup = Setup(vocoder, None if tokenizer is None else str(tokenizer), asr, speaker_encoder, mos)
        score_audio(report, inputs.prompts, speech, setup, out_dir, audio_dir, scoring_workers, progress)
    if sweeps:
        report["frontier"] = frontier(report)
    if out_dir is not None:
        write_report(report, Path(out_dir))
    return report


def _sampler(sampler) -> tuple[str | None, object]:
    """(the preset's name or None, the sampling rule) for bench's `sampler`: a name, a rule or None (RAS)."""
    from ...decoder import RAS, presets

    if isinstance(sampler, str):
        return sampler, presets.sampler(sampler)
    return None, sampler or RAS()


def systems(inputs: DecodeInputs, policies: list[str], stores: list[str], sweep_nodes, sweep_depths,
            sweep_policies: list[str], max_nodes, max_depth: int, max_new_tokens: int, hf_baselines: bool, sampler,
            attach: dict, sweeps: dict) -> list[System]:
    """The baselines, each policy on each store, and the sweeps (on the first store), each with its baseline:
    greedy systems against HF `generate` (or echospec's own loop where `generate` cannot run the model),
    sampling systems against autoregressive sampling with the same sampler."""
    model, retriever, speech, relaxed = inputs.model, inputs.retriever, inputs.speech, inputs.relaxed
    counter = ForwardCounter(model)
    stop_ids = list(speech.stop_ids)

    def hf(**extra):
        return hf_generate_run(model, counter, max_new_tokens=max_new_tokens, eos_token_id=stop_ids,
                               pad_token_id=stop_ids[0], **extra)

    def echospec(policy, store, nodes, depth, settings=relaxed):
        return echospec_run(model, retriever if store else None,
                            lambda seed: make_policy(policy, seed, settings, sampler), speech,
                            speaker=store == "speaker", record_logits=bool(store) and policy.startswith("exact"),
                            max_new_tokens=max_new_tokens, max_nodes=nodes, max_depth=depth, **attach)

    if hf_baselines:
        out = [
            System("autoregressive", hf()),
            System("hf-prompt-lookup", hf(prompt_lookup_num_tokens=10), "autoregressive", "autoregressive"),
        ]
    else:  # a model with its own head, or embeddings prompts: Hugging Face generate cannot run it
        out = [System("autoregressive", echospec("exact-greedy", None, 0, 1))]
    if sweeps or any(p != "exact-greedy" for p in policies):
        out.append(System("ar-sampling", echospec("exact-sampling", None, 0, 1)))
    for policy in policies:
        baseline = "autoregressive" if policy == "exact-greedy" else "ar-sampling"
        lossless = baseline if policy.startswith("exact") else None
        for store in stores:
            out.append(System(f"{policy}/{store}", echospec(policy, store, max_nodes, max_depth), baseline, lossless))
    for policy, knob, value, settings in swept_settings(sweeps, relaxed):
        out.append(System(f"{policy}/{stores[0]}/{knob}={value}",
                          echospec(policy, stores[0], max_nodes, max_depth, settings), "ar-sampling"))
    for policy in sweep_policies or ["exact-sampling" if "exact-sampling" in policies else policies[0]]:
        baseline = "autoregressive" if policy == "exact-greedy" else "ar-sampling"
        lossless = baseline if policy.startswith("exact") else None
        for nodes in sweep_nodes:
            for depth in sweep_depths:
                if (nodes, depth) != (max_nodes, max_depth):
                    name = f"{policy}/{stores[0]}/n{nodes}d{depth}"
                    out.append(System(name, echospec(policy, stores[0], nodes, depth), baseline, lossless))
    return out


def verify_cost_curve(model, speech, prompts: list[Prompt], largest: int, context: int = 150, **attach):
    """This machine's forward time against tree size for `model`, relative to a one-token step.

    Measured mid-utterance (the prompt plus up to `context` tokens of its reference speech), since a tree
    forward's cost grows with the context faster than a one-token step's; after the prompt alone for
    embeddings prompts. Returns (curve, context length).
    """
    from .cost import CURVE_SIZES

    sizes = sorted({s for s in CURVE_SIZES if s < largest} | {largest})
    prompt = max(prompts, key=lambda p: len(p.reference or ()))
    if prompt.input_ids is None:
        embeds = prompt.inputs_embeds
        curve = measure_cost_curve(model, speech, None, sizes, repeats=20, inputs_embeds=embeds, **attach)
        return curve, int(embeds.shape[-2])
    ids = prompt.input_ids + speech.to_model((prompt.reference or [])[:context])
    return measure_cost_curve(model, speech, ids, sizes, repeats=20, **attach), len(ids)


def decode(systems: list[System], inputs: DecodeInputs, curve, *, rounds: int, seed: int, tokenizer, attach: dict,
           progress: bool) -> tuple[dict, dict]:
    """Every prompt `rounds` times with every system, in a balanced order, each utterance with seed `seed` + its
    index. Returns (rows: per system, one dict per utterance; budgets: per "auto" system, its last budget state).
    Each system's accepted lengths are added to its `accepted`."""
    from tqdm import tqdm

    from ...decoder.scoring import mean_log_likelihood

    mel = None
    if tokenizer:
        from ..corpus.speech_tokenizer import SpeechTokenizer

        mel = SpeechTokenizer.load(tokenizer).tokens_to_logmel
    speech = inputs.speech
    rows = {s.name: [] for s in systems}
    budgets = {}
    utterances = [(round_, prompt) for round_ in range(rounds) for prompt in inputs.prompts]
    for i, (round_, prompt) in enumerate(tqdm(utterances, desc="bench", unit="utt", disable=not progress)):
        scored_prompt = {k: v for k, v in prompt.inputs().items() if k != "prompt_speech"}
        recorded = {}
        for system in balanced_order(systems, i):
            run = system.run(prompt, seed + i)
            system.accepted.extend(run.accepted)
            recorded[system.name] = run.logits
            budgets[system.name] = run.budget or budgets.get(system.name)
            speech_tokens = speech.to_local(run.tokens)
            rows[system.name].append({
                "prompt": prompt.id, "round": round_, "tokens": run.tokens, "new_tokens": len(run.tokens),
                "forwards": run.forwards,
                "seconds": run.seconds, "time_per_token": run.time_per_token,
                "forward_seconds": run.forward_seconds, "accept_seconds": run.accept_seconds,
                # the prefill, then each step's forward in one-token-step units of this machine's curve
                "forward_cost": (None if run.tree_sizes is None
                                 else 1 + float(np.sum(curve.time(run.tree_sizes))) / curve.seconds[0]),
                "log_likelihood": mean_log_likelihood(inputs.scorer, run.tokens, **scored_prompt, **attach),
                "mel_distortion": (dtw_distance(mel(speech_tokens), mel(prompt.reference))
                                   if mel is not None and prompt.reference and speech_tokens else None),
            } | ({"caps": run.caps} if run.caps is not None else {}))
        locate_divergences(systems, rows, recorded, prompt, inputs.model, attach)
    return rows, budgets


def locate_divergences(systems: list[System], rows: dict, recorded: dict, prompt: Prompt, model, attach: dict) -> None:
    """Where a lossless system's latest utterance left its baseline's: rounding, or a bug? Adds `divergence` to
    the row; the plain forward replays the output one token at a time, so only for the first few divergences,
    and only where a plain forward can run (ids prompts, no head of its own)."""
    replayable = prompt.input_ids is not None and all(v is None for v in attach.values())
    for system in systems:
        if system.lossless_of:
            row, base = rows[system.name][-1], rows[system.lossless_of][-1]
            plain = replayable and sum(bool(r.get("divergence")) for r in rows[system.name]) < DIVERGENCE_LOGITS
            row["divergence"] = divergence(model if plain else None, prompt.input_ids, row["tokens"],
                                           base["tokens"], recorded[system.name])
