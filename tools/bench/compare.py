"""`bench`: autoregressive, HF prompt lookup and echospec's policies side by side on one model and store.

Every system decodes every prompt; the order of systems rotates from prompt to prompt (A B C, B C A, ...)
so drift on a noisy machine hits all of them alike. Speed is reported as the ratio of median time per
token to the system's baseline (greedy systems: HF `generate`; sampling systems: autoregressive sampling
with the same sampler); quality as the target's mean log-likelihood of what was generated and, where the
tokenizer is known, the log-mel DTW distortion against the reference utterance, each with a 95%
bootstrap interval over utterances.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ...datastore.files import atomic_file
from ..corpus.tts_prompt import TTSMeta, encode_prompt
from .harness import (
    POLICIES,
    BenchError,
    ForwardCounter,
    Prompt,
    RelaxedSettings,
    System,
    balanced_order,
    echospec_run,
    hf_generate_run,
    make_policy,
    measure_cost_curve,
    plot_cost_curve,
    pyplot,
    save_figure,
    warm_up,
)
from .divergence import divergence
from .quality import bootstrap_ci, dtw_distance, median_ratio_ci, ratio_of_medians_ci, relative_difference_ci

__all__ = ["POLICIES", "BenchError", "bench", "format_table", "load_prompts", "summarise"]

DIVERGENCE_LOGITS = 20  # per system, the divergent utterances whose logits are compared (each replays its output)


def load_prompts(prompts, meta: TTSMeta | None, limit: int | None = None) -> list[Prompt]:
    """Prompts from a JSONL file (or, from Python, a list of dicts of the same fields).

    Each gives `input_ids` (model ids); or `text` + `speaker` for an echospec TTS checkpoint; or
    `inputs_embeds` — a .pt/.npy file (relative to the JSONL file) holding [T, H] or [1, T, H], or from
    Python a tensor, an array or a callable returning one — with `prompt_speech` (the store-local ids of the
    prompt's speech). `speaker`, `id` and `reference_tokens` are optional.
    """
    if isinstance(prompts, (str, Path)):
        try:
            lines = Path(prompts).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise BenchError(f"cannot read prompts file {prompts}: {e.strerror}") from None
        rows, folder = [(f"{prompts}:{n}", line) for n, line in enumerate(lines, 1) if line.strip()], Path(prompts).parent
    else:
        rows, folder = [(f"prompt {n}", row) for n, row in enumerate(prompts, 1)], Path.cwd()
    out = []
    for where, row in rows[:limit]:
        try:
            row = json.loads(row) if isinstance(row, str) else dict(row)
            ids, embeds = None, None
            if "input_ids" in row:
                ids = [int(t) for t in row["input_ids"]]
            elif "inputs_embeds" in row:
                embeds = _embeddings(row["inputs_embeds"], folder)
            elif meta is not None:
                ids = encode_prompt(meta, row["text"], row["speaker"])
            else:
                raise BenchError("no input_ids or inputs_embeds, and the checkpoint has no echospec_tts.json to "
                                 "encode text")
            speech = row.get("prompt_speech")
            out.append(Prompt(str(row.get("id", len(out) + 1)), row.get("speaker"), ids, row.get("reference_tokens"),
                              embeds, None if speech is None else [int(t) for t in speech]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, OSError) as e:
            raise BenchError(f"{where}: bad prompt ({e})") from None
    if not out:
        raise BenchError(f"{prompts if isinstance(prompts, (str, Path)) else 'prompts'} holds no prompts")
    return out


def _embeddings(value, folder: Path):
    """A prompt's embeddings as a float tensor: from a .pt/.npy path, an array or tensor, or a callable."""
    import torch

    if callable(value):
        value = value()
    if isinstance(value, (str, Path)):
        path = folder / value
        value = torch.load(path, weights_only=True) if path.suffix == ".pt" else np.load(path, allow_pickle=False)
    embeds = torch.as_tensor(value)
    if embeds.dim() not in (2, 3) or not embeds.is_floating_point():
        raise ValueError(f"inputs_embeds must be a float [T, H] or [1, T, H] array, got {embeds.dtype} "
                         f"{tuple(embeds.shape)}")
    return embeds


def _systems(model, retriever, speech, policies, stores, sweep_nodes, sweep_depths, sweep_policies, max_nodes,
             max_depth, max_new_tokens, relaxed: RelaxedSettings, hf_baselines: bool, sampler,
             attach: dict) -> list[System]:
    counter = ForwardCounter(model)
    stop_ids = list(speech.stop_ids)

    def hf(**extra):
        return hf_generate_run(model, counter, max_new_tokens=max_new_tokens, eos_token_id=stop_ids,
                               pad_token_id=stop_ids[0], **extra)

    def echospec(policy, store, nodes, depth):
        return echospec_run(model, retriever if store else None,
                            lambda seed: make_policy(policy, seed, relaxed, sampler), speech,
                            speaker=store == "speaker", record_logits=bool(store) and policy.startswith("exact"),
                            max_new_tokens=max_new_tokens, max_nodes=nodes, max_depth=depth, **attach)

    if hf_baselines:
        systems = [
            System("autoregressive", hf()),
            System("hf-prompt-lookup", hf(prompt_lookup_num_tokens=10), "autoregressive", "autoregressive"),
        ]
    else:  # a model with its own head, or embeddings prompts: Hugging Face generate cannot run it
        systems = [System("autoregressive", echospec("exact-greedy", None, 0, 1))]
    if any(p != "exact-greedy" for p in policies):
        systems.append(System("ar-sampling", echospec("exact-sampling", None, 0, 1)))
    for policy in policies:
        greedy = policy == "exact-greedy"
        baseline = "autoregressive" if greedy else "ar-sampling"
        lossless = baseline if policy.startswith("exact") else None
        for store in stores:
            systems.append(System(f"{policy}/{store}", echospec(policy, store, max_nodes, max_depth), baseline, lossless))
    for policy in sweep_policies or ["exact-sampling" if "exact-sampling" in policies else policies[0]]:
        baseline = "autoregressive" if policy == "exact-greedy" else "ar-sampling"
        lossless = baseline if policy.startswith("exact") else None
        for nodes in sweep_nodes:
            for depth in sweep_depths:
                if (nodes, depth) != (max_nodes, max_depth):
                    name = f"{policy}/{stores[0]}/n{nodes}d{depth}"
                    systems.append(System(name, echospec(policy, stores[0], nodes, depth), baseline, lossless))
    return systems


def verify_cost_curve(model, speech, prompts: list[Prompt], largest: int, context: int = 150, **attach):
    """This machine's forward time against tree size for `model`, relative to a one-token step.

    Measured mid-utterance (the prompt plus up to `context` tokens of its reference speech), since a tree
    forward's cost grows with the context faster than a one-token step's; after the prompt alone for
    embeddings prompts. Returns (curve, context length).
    """
    from ...decoder.cost import CURVE_SIZES

    sizes = sorted({s for s in CURVE_SIZES if s < largest} | {largest})
    prompt = max(prompts, key=lambda p: len(p.reference or ()))
    if prompt.input_ids is None:
        embeds = prompt.inputs_embeds
        curve = measure_cost_curve(model, speech, None, sizes, repeats=20, inputs_embeds=embeds, **attach)
        return curve, int(embeds.shape[-2])
    ids = prompt.input_ids + speech.to_model((prompt.reference or [])[:context])
    return measure_cost_curve(model, speech, ids, sizes, repeats=20, **attach), len(ids)


def load_model(checkpoint):
    """(model, echospec TTS meta or None) of a checkpoint folder — an echospec TTS checkpoint or any Hugging Face
    causal LM — or of an already loaded model."""
    from ..corpus.tts_prompt import META_FILE, load_sample_tts

    if not isinstance(checkpoint, (str, Path)):
        return checkpoint, None
    if (Path(checkpoint) / META_FILE).exists():
        return load_sample_tts(checkpoint)
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa")
    except (OSError, ValueError) as e:
        raise BenchError(f"{checkpoint}: not a Hugging Face causal LM checkpoint ({str(e).splitlines()[0]})") from None
    return model.eval(), None


class DecodeInputs(NamedTuple):
    """What a benchmark decodes with (see `decode_inputs`)."""

    model: object
    scorer: object  # the model in float32 to score log-likelihoods with (None unless `with_scorer`)
    meta: TTSMeta | None  # an echospec TTS checkpoint's, else None
    retriever: object
    speech: object  # the model's SpeechVocab
    prompts: list[Prompt]
    relaxed: RelaxedSettings


def decode_inputs(checkpoint, store, prompts, limit: int | None = None, threads: int = 1, device: str = "cpu",
                  dtype: str = "float32", *, speech=None, speech_offset: int | None = None,
                  vocab_size: int | None = None, stop_ids=(), tau: int | None = None, beta: float = 0.2,
                  similarity: float = 0.3, with_scorer: bool = False) -> DecodeInputs:
    """The model (on `device`, in `dtype`), retriever, speech ids, prompts and relaxed policies' settings for
    `checkpoint`, `store` and `prompts`, with `threads` torch threads; the options as `bench` takes them.
    `with_scorer` also keeps a float32 copy to score with (a second model in memory outside float32)."""
    import torch

    from ...retriever import Retriever

    torch.set_num_threads(threads)
    model, meta = load_model(checkpoint)
    model, scorer = on_device(model, device, dtype) if with_scorer else (placed(model, device, dtype), None)
    retriever = Retriever(store)
    speech = speech or speech_vocab(meta, retriever.datastore, model, speech_offset, vocab_size, stop_ids)
    return DecodeInputs(model, scorer, meta, retriever, speech, load_prompts(prompts, meta, limit),
                        RelaxedSettings.for_vocabulary(speech.size, tau, beta, similarity))


def speech_vocab(meta: TTSMeta | None, datastore, model, speech_offset=None, vocab_size=None, stop_ids=()):
    """The model's speech ids: the options given, else an echospec checkpoint's, else the store's (its stop
    ids, else the model's eos); the codebook layout is the store's."""
    from ...decoder import SpeechVocab

    if meta is not None and speech_offset is None and vocab_size is None and not stop_ids:
        return SpeechVocab(meta.speech_offset, meta.speech_vocab_size, (meta.stop_id,))
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    stops = tuple(stop_ids) or datastore.stop_ids or eos
    if not stops:
        raise BenchError("no stop id: give --stop-id (the build's), or build the store with it")
    return SpeechVocab(datastore.speech_offset if speech_offset is None else int(speech_offset),
                       datastore.vocab_size if vocab_size is None else int(vocab_size), stops, datastore.codebooks)


def bench(checkpoint, store, prompts, *, speech=None, speech_offset: int | None = None, vocab_size: int | None = None,
          stop_ids=(), head=None, speech_embedding=None, sampler=None, token_rate: float | None = None,
          tokenizer=None, policies=POLICIES, stores=("speaker", "general"),
          max_nodes: int | str = "auto", max_depth: int = 8, sweep_nodes=(), sweep_depths=(), sweep_policies=(),
          limit: int | None = None, rounds: int = 1, max_new_tokens: int = 400, threads: int = 1, seed: int = 0,
          tau: int | None = None, beta: float = 0.2, similarity: float = 0.3, device: str = "cpu",
          dtype: str = "float32", out_dir=None, progress: bool = True) -> dict:
    """Decode `prompts` with every system; return (and write to `out_dir`) the report as a dict.

    `checkpoint`: an echospec TTS checkpoint folder, any Hugging Face causal LM folder, or (from Python) a
    loaded model — with `head` and `speech_embedding` for a model with its own speech head and table, as
    `generate` takes them (CosyVoice: `llm.llm.model`, head=llm.llm_decoder, speech_embedding=llm.speech_embedding).
    Speech ids: `speech` (a SpeechVocab, e.g. a preset's), else `speech_offset`, `vocab_size`, `stop_ids`
    (the build's names), else the checkpoint's or the store's. `prompts`: see `load_prompts`. `sampler`
    (default RAS) is what the sampling policies and their baseline sample with; `token_rate` (speech tokens
    a second, default the checkpoint's or 25) scales the LM real-time factor. Hugging Face `generate` is the
    greedy baseline where it can run the model (no head, ids prompts); else echospec's own autoregressive loop.
    Every prompt is decoded `rounds` times, each utterance with its own seed (`seed` + its index).

    `device` and `dtype` ("float32", "bfloat16", "float16") are where and in what precision every system
    runs; the log-likelihood is then scored by a float32 copy of the model, so every dtype is judged on one
    scale. For each utterance where a lossless system's tokens differ from its baseline's, the report
    gives the first divergent position and the largest logit difference there between the system's forward
    and a plain one-token forward (`divergences`): rounding (tiny differences at a near-tie) or a bug.
    """
    import torch
    from tqdm import tqdm

    from ...decoder.cost import node_cap
    from ...decoder.scoring import mean_log_likelihood

    unknown = set(sweep_policies) - set(policies)
    if unknown:
        raise BenchError(f"sweep policies {', '.join(sorted(unknown))} are not among the benchmarked policies")
    source = prompts
    model, scorer, meta, retriever, speech, prompts, relaxed = decode_inputs(
        checkpoint, store, prompts, limit, threads, device, dtype, speech=speech, speech_offset=speech_offset,
        vocab_size=vocab_size, stop_ids=stop_ids, tau=tau, beta=beta, similarity=similarity, with_scorer=True)
    attach = {"head": head, "speech_embedding": speech_embedding}
    hf_baselines = head is None and speech_embedding is None and all(p.input_ids is not None for p in prompts)
    mel = None
    if tokenizer:
        from ..corpus.speech_tokenizer import SpeechTokenizer

        mel = SpeechTokenizer.load(tokenizer).tokens_to_logmel
    systems = _systems(model, retriever, speech, list(policies), list(stores), sweep_nodes, sweep_depths or (max_depth,),
                       list(sweep_policies), max_nodes, max_depth, max_new_tokens, relaxed, hf_baselines, sampler,
                       attach)

    warm_up(systems, prompts[0], seed)
    curve, curve_context = verify_cost_curve(model, speech, prompts, max(node_cap(n) for n in [max_nodes, *sweep_nodes]),
                                             **attach)
    rows = {s.name: [] for s in systems}
    budgets = {}
    utterances = [(round_, prompt) for round_ in range(rounds) for prompt in prompts]
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
                # the prefill, then each step's forward in one-token-step units of this machine's curve
                "forward_cost": (None if run.tree_sizes is None
                                 else 1 + float(np.sum(curve.time(run.tree_sizes))) / curve.seconds[0]),
                "log_likelihood": mean_log_likelihood(scorer, run.tokens, **scored_prompt, **attach),
                "mel_distortion": (dtw_distance(mel(speech_tokens), mel(prompt.reference))
                                   if mel is not None and prompt.reference and speech_tokens else None),
            } | ({"caps": run.caps} if run.caps is not None else {}))
        for system in systems:  # where a lossless system left its baseline: rounding, or a bug?
            if system.lossless_of:
                row, base = rows[system.name][-1], rows[system.lossless_of][-1]
                # the plain forward replays the output one token at a time: for the first few divergences only
                plain = (prompt.input_ids is not None and head is None and speech_embedding is None
                         and sum(bool(r.get("divergence")) for r in rows[system.name]) < DIVERGENCE_LOGITS)
                row["divergence"] = divergence(model if plain else None, prompt.input_ids, row["tokens"],
                                               base["tokens"], recorded[system.name])
    rate = meta.frame_rate if meta is not None and token_rate is None else (token_rate or 25.0)
    report = summarise(systems, rows, token_rate=rate)
    report["machine"] = {"threads": threads, "torch": torch.__version__, "cpus": os.cpu_count(), "device": device,
                         "dtype": dtype, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                         "native_bfloat16": native_bfloat16(device)}
    report["verify_cost_curve"] = curve.to_dict() | {"context_tokens": curve_context}
    report["auto_budgets"] = {name: state for name, state in budgets.items() if state}  # each cap's rate, at the end
    report["auto_against_fixed"] = auto_against_fixed(rows)
    report["setup"] = {"checkpoint": str(checkpoint) if isinstance(checkpoint, (str, Path)) else type(model).__name__,
                       "store": str(store), "prompts": str(source) if isinstance(source, (str, Path)) else "python",
                       "utterances": len(utterances), "rounds": rounds, "max_nodes": max_nodes,
                       "max_depth": max_depth, "seed": seed,
                       "device": device, "dtype": dtype,
                       "speech": {"offset": speech.offset, "size": speech.size, "stop_ids": list(speech.stop_ids),
                                  "codebooks": speech.codebooks},
                       "relaxed": asdict(relaxed)}
    if out_dir is not None:
        write_report(report, systems, Path(out_dir))
    return report


def summarise(systems: list[System], rows: dict, token_rate: float) -> dict:
    """Per-system medians, ratios to the baseline, tokens per forward and quality intervals."""
    median_tpt = {name: float(np.median([r["time_per_token"] for r in runs])) for name, runs in rows.items()}
    tokens_per_cost = {name: sum(r["new_tokens"] for r in runs) / sum(r["forward_cost"] for r in runs)
                       for name, runs in rows.items() if all(r["forward_cost"] is not None for r in runs)}
    summary = {}
    for system in systems:
        runs = rows[system.name]
        tpt, base_tpt = [r["time_per_token"] for r in runs], [r["time_per_token"] for r in rows[system.baseline]]
        entry = {
            "baseline": system.baseline,
            "tokens_per_forward": sum(r["new_tokens"] for r in runs) / max(sum(r["forwards"] for r in runs), 1),
            "time_per_token_ms": {"median": 1e3 * median_tpt[system.name], "min": 1e3 * min(tpt), "max": 1e3 * max(tpt)},
            "speedup": median_tpt[system.baseline] / median_tpt[system.name],
            # how far resampling the utterances moves it: at ~100 utterances often +-3%
            "speedup_ci95": ratio_of_medians_ci(base_tpt, tpt).to_dict()["ci95"],
            # each utterance's ratio to its baseline's, the median of those: less spread than the ratio of medians
            "speedup_paired": median_ratio_ci(base_tpt, tpt).to_dict("median"),
            # what the forwards alone predict on this machine (retriever, mask, walk and cache work free)
            "forward_cost_speedup": (tokens_per_cost[system.name] / tokens_per_cost[system.baseline]
                                     if system.name in tokens_per_cost else None),
            "lm_rtf": float(np.median([r["time_per_token"] * token_rate for r in runs])),
            "new_tokens": sum(r["new_tokens"] for r in runs),
            "log_likelihood": bootstrap_ci([r["log_likelihood"] for r in runs]).to_dict(),
            "accepted_lengths": np.bincount(system.accepted).tolist() if system.accepted else [],
        }
        mel = [r["mel_distortion"] for r in runs if r["mel_distortion"] is not None]
        entry["mel_distortion"] = bootstrap_ci(mel).to_dict() if mel else None
        if system.baseline != system.name:  # quality change against the baseline, paired by utterance
            base = rows[system.baseline]
            entry["relative_change"] = {
                measure: relative_difference_ci([r[measure] for r in runs], [b[measure] for b in base]).to_dict()
                for measure in ("log_likelihood", "mel_distortion")
                if all(r[measure] is not None for r in runs + base)
            }
        if system.lossless_of:
            # Greedy: identity is the claim. Sampling: the policies draw one number per emitted token
            # from the same seed as autoregressive sampling, so identity is expected there too, up to
            # float round-off between a tree forward and a one-token forward flipping a rare draw.
            reference = rows[system.lossless_of]
            entry["identical_to_baseline"] = sum(a["tokens"] == b["tokens"] for a, b in zip(runs, reference)) / len(runs)
            entry["divergences"] = [r["divergence"] | {"prompt": r["prompt"]} for r in runs if r.get("divergence")]
        summary[system.name] = entry
    return {"systems": summary, "utterances": rows}


def auto_against_fixed(rows: dict) -> dict:
    """For each "auto" system (its utterances record their caps), its speed over each fixed budget swept beside
    it with the same policy and store: the median over utterances of the fixed system's time per token over
    auto's, with a 95% interval. Above 1: "auto" was faster. Paired by utterance, since the question is whether
    to pin that budget, and both systems met the same prompts at nearly the same moment."""
    compared = {}
    for name, runs in rows.items():
        if not runs or "caps" not in runs[0]:
            continue
        auto = [r["time_per_token"] for r in runs]
        fixed = {other[len(name) + 1:]: median_ratio_ci([r["time_per_token"] for r in rows[other]], auto)
                 .to_dict("median") for other in rows if other.startswith(f"{name}/n")}
        if fixed:
            compared[name] = fixed
    return compared


def format_table(report: dict) -> str:
    """One row per system; quality changes are relative to the system's baseline, with 95% intervals."""
    from ...decoder.cost import FIRST_ARM, SETTLE

    def change(entry, measure):
        ci = entry.get("relative_change", {}).get(measure)
        return f"{100 * ci['mean']:+5.1f}% [{100 * ci['ci95'][0]:+5.1f},{100 * ci['ci95'][1]:+5.1f}]" if ci else "-"

    header = (f"{'system':32} {'tok/fwd':>7} {'TPT ms':>7} {'speed-up':>8} {'95% CI':>13} {'paired':>7} {'fwd-cost':>8} "
              f"{'LM RTF':>6} {'log-lik':>7} {'vs baseline':>21} {'mel-DTW':>7} {'vs baseline':>21} {'same':>5} {'max dlogit':>10}")
    lines = [header, "-" * len(header)]
    for name, s in report["systems"].items():
        mel = s["mel_distortion"]
        same = s.get("identical_to_baseline")
        predicted = s.get("forward_cost_speedup")
        lines.append(
            f"{name:32} {s['tokens_per_forward']:7.2f} {s['time_per_token_ms']['median']:7.2f} {s['speedup']:7.2f}x "
            f"{'[{:.2f}, {:.2f}]'.format(*s['speedup_ci95']):>13} {s['speedup_paired']['median']:6.2f}x "
            f"{'-' if predicted is None else f'{predicted:.2f}x':>8} "
            f"{s['lm_rtf']:6.3f} {s['log_likelihood']['mean']:7.3f} {change(s, 'log_likelihood'):>21} "
            f"{mel['mean'] if mel else float('nan'):7.2f} {change(s, 'mel_distortion'):>21} "
            f"{'-' if same is None else f'{same:.2f}':>5} {_largest_difference(s):>10}")
    curve = report.get("verify_cost_curve")
    lines += ["", "speed-up: the baseline's median time per token over the system's; paired: the median over utterances "
              "of each one's ratio (prompt, length and the machine's state of the moment cancel)",
              "same: share of utterances token for token the baseline's; max dlogit: over the others, the largest "
              "logit difference at the first divergent token between the system's forward and a plain one-token "
              "forward (rounding flips near-ties at ~1e-6 in float32, ~1e-2 in bfloat16; a bug shows far larger)"]
    setup = report.get("setup", {})
    utterances = setup.get("utterances")
    if setup.get("max_nodes") == "auto" and utterances is not None and utterances < 4 * SETTLE:
        lines += ["", f"auto (the node budget): each system's first {SETTLE} utterances measure its caps, so over "
                  f"{utterances} its figures are mostly that measuring, not the cap it settles on; run more "
                  f"prompts or --rounds, or pin a budget (--nodes {FIRST_ARM})"]
    against = report.get("auto_against_fixed")
    if against:
        lines += ["", "auto against the fixed budgets swept beside it (paired: each utterance's time per token under the "
                  "budget over auto's, median and 95% interval; below 1 with its whole interval, pinning that budget was faster):"]
        lines += [f"  {name}: " + ", ".join(f"{budget} {r['median']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"
                                            for budget, r in fixed.items()) for name, fixed in against.items()]
    if curve:
        points = ", ".join(f"{n}: {r:.2f}" for n, r in zip(curve["sizes"], curve["relative"]))
        lines += ["",
                  (f"verify-cost curve (tree nodes: forward time / one-token step, {curve['context_tokens']}-token "
                   f"context): {points}"),
                  ("fwd-cost: the speed-up this curve predicts from the steps' tree sizes alone; tok/fwd: the speed-up "
                   "where a tree forward costs one step")]
    return "\n".join(lines)


def _largest_difference(entry: dict) -> str:
    differences = [d["max_logit_difference"] for d in entry.get("divergences", ())
                   if d.get("max_logit_difference") is not None]
    if "divergences" not in entry:
        return "-"
    return f"{max(differences):.1e}" if differences else ("0" if not entry["divergences"] else "?")


def on_device(model, device: str, dtype: str):
    """(the model on `device` in `dtype`, a float32 copy to score log-likelihoods with: the model itself in
    float32)."""
    import copy

    model = placed(model, device, "float32")
    return (model, model) if dtype == "float32" else (placed(copy.deepcopy(model), device, dtype), model)


def placed(model, device: str, dtype: str):
    """The model on `device` in `dtype` (float32, bfloat16 or float16)."""
    import torch

    if dtype not in ("float32", "bfloat16", "float16"):
        raise BenchError(f"unknown dtype {dtype!r}; choose float32, bfloat16 or float16")
    try:
        return model.to(device=device, dtype=getattr(torch, dtype))
    except (RuntimeError, AssertionError) as e:
        raise BenchError(f"cannot put the model on {device!r}: {str(e).splitlines()[0]}") from None


def native_bfloat16(device: str = "cpu") -> bool:
    """Whether `device` computes in bfloat16 natively: a CUDA GPU that says so, a CPU with AVX512-BF16 or AMX
    (elsewhere torch emulates bfloat16 on the CPU, slower than float32)."""
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def write_report(report: dict, systems: list[System], out_dir: Path) -> None:
    """bench.json, bench.md and bench.png in `out_dir`, each written to a temporary file and renamed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_file(out_dir / "bench.json") as f:
        json.dump(report, f, indent=1)
    with atomic_file(out_dir / "bench.md") as f:
        f.write("```\n" + format_table(report) + "\n```\n")
    plot(report, systems, out_dir / "bench.png")


def plot(report: dict, systems: list[System], path: Path) -> None:
    """Accepted tree nodes per step for each echospec system; speed-up against quality; the verify-cost curve;
    where max_nodes="auto" ran, the caps it chose over the run."""
    plt = pyplot()
    # rows without caps (a report from before they were recorded) are left out
    auto = {name: runs for name, runs in report["utterances"].items() if any("caps" in run for run in runs)}
    fig, axes = plt.subplots(1, 3 + bool(auto), figsize=(19 + 6 * bool(auto), 5.5),
                             gridspec_kw={"width_ratios": [3, 3, 2] + [3] * bool(auto)})
    left, right, cost = axes[:3]
    palette = plt.get_cmap("tab20")
    colors = {system.name: palette(i % 20) for i, system in enumerate(systems)}  # one per system, in every panel
    for system in systems:
        color = colors[system.name]
        if system.accepted and system.name not in ("autoregressive", "ar-sampling"):
            counts = np.bincount(system.accepted)
            left.plot(np.arange(len(counts)), counts / counts.sum(), marker="o", color=color, label=system.name)
        s = report["systems"][system.name]
        ll = s["log_likelihood"]
        low, high = s["speedup_ci95"]
        right.errorbar(s["speedup"], ll["mean"], yerr=[[ll["mean"] - ll["ci95"][0]], [ll["ci95"][1] - ll["mean"]]],
                       xerr=[[s["speedup"] - low], [high - s["speedup"]]],
                       fmt="o", capsize=3, color=color, label=system.name)
    left.set(xlabel="tree nodes accepted in a step", ylabel="share of steps", title="Accepted lengths")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    right.set(xlabel="speed-up over its baseline (median time per token, 95% CI)",
              ylabel="target mean log-likelihood (95% CI)", title="Speed against quality")
    curve = report.get("verify_cost_curve")
    if curve:
        plot_cost_curve(cost, curve, label="this machine")
        cost.axhline(1.0, color="grey", linestyle="--", label="flat (a GPU, roughly)")
        cost.legend(fontsize=7)
    if auto:
        plot_auto_caps(axes[3], auto, colors)
    fig.tight_layout()
    save_figure(fig, path)


def plot_auto_caps(ax, auto: dict, colors: dict, window: int = 400) -> None:
    """Each auto system's steps in decoding order, over a moving window of `window` steps (or all, if fewer):
    the share run as trees (solid, left axis) and those steps' mean cap (dotted, right axis); `colors` by name."""
    caps_axis = ax.twinx()
    for name, runs in auto.items():
        caps = np.array([cap for run in runs for cap in run.get("caps", ())], float)
        if not len(caps):
            continue
        kernel = np.ones(min(window, len(caps))) / min(window, len(caps))
        trees = np.convolve(caps > 0, kernel, mode="valid")
        mean_cap = np.convolve(caps, kernel, mode="valid") / np.maximum(trees, 1e-9)
        steps = np.arange(len(kernel), len(caps) + 1)
        ax.plot(steps, trees, color=colors[name], label=name)
        caps_axis.plot(steps[trees > 0], mean_cap[trees > 0], color=colors[name], linestyle=":")
    ax.set(xlabel="decode step (all utterances, in order)", ylabel="share of steps on trees (solid)",
           ylim=(-0.02, 1.02), title=f'max_nodes="auto": its choices ({window}-step window)')
    caps_axis.set_yscale("log", base=2)
    caps_axis.set(ylim=(3, 80), ylabel="their mean cap (dotted)")
    caps_axis.set_yticks([4, 8, 16, 32, 64], ["4", "8", "16", "32", "64"])
    caps_axis.minorticks_off()
    ax.legend(fontsize=7)
