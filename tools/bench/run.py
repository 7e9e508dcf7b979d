"""`bench`: autoregressive, HF prompt lookup and echospec's policies side by side on one model and store.

Every system decodes every prompt; the order of systems changes from prompt to prompt (`balanced_order`)
so drift on a noisy machine hits all of them alike. Speed is reported as the ratio of median time per
token to the system's baseline (greedy systems: HF `generate`; sampling systems: autoregressive sampling
with the same sampler); quality as the target's mean log-likelihood of what was generated and, where the
tokenizer is known, the log-mel DTW distortion against the reference utterance, each with a 95%
bootstrap interval over utterances.

    bench       one BenchSpec (spec.py): load (load.py), build the systems, decode every prompt with each,
                report (report.py)
    systems     the systems a bench compares, each with its baseline, named by SystemName
    decode      every utterance with every system: the rows the report summarises
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from ..audio.scorers import Setup
from ..audio import quality_missing
from .audio import score_audio
from .divergence import divergence
from .frontier import frontier, swept_settings
from .harness import (
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
from .load import Loaded, decode_inputs, native_bfloat16
from .machine import machine
from .quality import dtw_distance
from .report import auto_against_fixed, summarise, write_report
from .spec import BenchSpec, SystemName

DIVERGENCE_LOGITS = 20  # per system, the divergent utterances whose logits are compared (each replays its output)


def bench(spec: BenchSpec) -> dict:
    """Decode the prompts of `spec.inputs` with every system `spec` asks for; return (and write to `spec.out_dir`)
    the report as a dict (its systems keyed by `str(SystemName)`).

    Hugging Face `generate` is the greedy baseline where it can run the model (no head, ids prompts); else
    echospec's own autoregressive loop. The log-likelihood is scored by a float32 copy of the model, so every
    dtype is judged on one scale. For each utterance where a lossless system's tokens differ from its baseline's,
    the report gives the first divergent position and the largest logit difference there between the system's
    forward and a plain one-token forward (`divergences`): rounding (tiny differences at a near-tie) or a bug.
    Scores on audio: see `Scoring`; with `sweeps`, the frontier (frontier.json, .md, .png) goes to `out_dir` too.
    """
    import torch

    from ...decoder.budget import CAPS, NODES

    unknown = set(spec.sweep_policies) - set(spec.policies)
    if unknown:
        raise BenchError(f"sweep policies {', '.join(sorted(unknown))} are not among the benchmarked policies")
    spec = replace(spec, max_nodes=NODES if spec.max_nodes is None else spec.max_nodes,
                   sweep_depths=spec.sweep_depths or (spec.max_depth,))
    sampler_name, sampler = _sampler(spec.sampler)
    inputs, scoring = spec.inputs, spec.scoring
    loaded = decode_inputs(inputs, with_scorer=True)
    compared = systems(loaded, spec, sampler)
    warm_up(compared, loaded.prompts[0], spec.seed)
    largest = max(max(CAPS) if n == "auto" else int(n) for n in [spec.max_nodes, *spec.sweep_nodes])
    curve, curve_context = verify_cost_curve(loaded.model, loaded.speech, loaded.prompts, largest, **inputs.attach)
    rows, budgets = decode(compared, loaded, curve, rounds=spec.rounds, seed=spec.seed, tokenizer=scoring.tokenizer,
                           attach=inputs.attach, progress=spec.progress)
    meta = loaded.meta
    rate = meta.frame_rate if meta is not None and inputs.token_rate is None else (inputs.token_rate or 25.0)
    report = summarise(compared, rows, token_rate=rate)
    report["machine"] = machine(threads=inputs.threads, device=inputs.device, dtype=inputs.dtype,
                                cpu_capability=torch.backends.cpu.get_cpu_capability(),
                                native_bfloat16=native_bfloat16(inputs.device))
    report["verify_cost_curve"] = curve.to_dict() | {"context_tokens": curve_context}
    # each "auto" cap's rate, at the end
    report["auto_budgets"] = {str(name): state for name, state in budgets.items() if state}
    report["auto_against_fixed"] = auto_against_fixed(rows)
    report["setup"] = setup(spec, loaded, sampler_name, sampler)
    audio = scoring.audio
    if audio is None:
        audio = (scoring.vocoder is not None or scoring.tokenizer is not None) and quality_missing() is None
    if audio or scoring.audio_dir is not None:
        chosen = Setup(scoring.vocoder, None if scoring.tokenizer is None else str(scoring.tokenizer), scoring.asr,
                       scoring.speaker_encoder, scoring.mos)
        score_audio(report, loaded.prompts, loaded.speech, chosen, spec.out_dir, scoring.audio_dir, scoring.workers,
                    spec.progress)
    if spec.sweeps:
        report["frontier"] = frontier(report)
    if spec.out_dir is not None:
        write_report(report, Path(spec.out_dir))
    return report


def setup(spec: BenchSpec, loaded: Loaded, sampler_name: str | None, sampler) -> dict:
    """What ran, as the report's setup records it."""
    inputs, speech = spec.inputs, loaded.speech
    checkpoint, prompts = inputs.checkpoint, inputs.prompts
    return {"checkpoint": (str(checkpoint) if isinstance(checkpoint, (str, Path)) else type(loaded.model).__name__),
            "store": str(inputs.store), "prompts": str(prompts) if isinstance(prompts, (str, Path)) else "python",
            "utterances": spec.rounds * len(loaded.prompts), "rounds": spec.rounds, "max_nodes": spec.max_nodes,
            "max_depth": spec.max_depth, "seed": spec.seed, "device": inputs.device, "dtype": inputs.dtype,
            "speech": {"offset": speech.offset, "size": speech.size, "stop_ids": list(speech.stop_ids),
                       "codebooks": speech.codebooks},
            "relaxed": asdict(spec.relaxed), "sampler": {"preset": sampler_name, "rule": repr(sampler)},
            "sweeps": dict(spec.sweeps)}


def _sampler(sampler) -> tuple[str | None, object]:
    """(the preset's name or None, the sampling rule) for bench's `sampler`: a name, a rule or None (RAS)."""
    from ...decoder import RAS, presets

    if isinstance(sampler, str):
        return sampler, presets.sampler(sampler)
    return None, sampler or RAS()


AUTOREGRESSIVE, AR_SAMPLING = SystemName("autoregressive"), SystemName("ar-sampling")


def systems(loaded: Loaded, spec: BenchSpec, sampler) -> list[System]:
    """The baselines, each policy on each store, and the sweeps (on the first store), each with its baseline:
    greedy systems against HF `generate` (or echospec's own loop where `generate` cannot run the model),
    sampling systems against autoregressive sampling with the same sampler."""
    model, retriever, speech, relaxed = loaded.model, loaded.retriever, loaded.speech, spec.relaxed
    attach = spec.inputs.attach
    counter = ForwardCounter(model)
    stop_ids = list(speech.stop_ids)
    first = spec.stores[0]

    def hf(**extra):
        return hf_generate_run(model, counter, max_new_tokens=spec.max_new_tokens, eos_token_id=stop_ids,
                               pad_token_id=stop_ids[0], **extra)

    def echospec(policy, store, nodes=spec.max_nodes, depth=spec.max_depth, settings=relaxed):
        return echospec_run(model, retriever if store else None,
                            lambda seed: make_policy(policy, seed, settings, sampler), speech,
                            speaker=store == "speaker", record_logits=bool(store) and policy.startswith("exact"),
                            max_new_tokens=spec.max_new_tokens, max_nodes=nodes, max_depth=depth, **attach)

    def judged(name: SystemName, run) -> System:
        """A policy's system: against autoregressive (greedy) or ar-sampling, and lossless for the exact ones."""
        baseline = AUTOREGRESSIVE if name.policy == "exact-greedy" else AR_SAMPLING
        return System(name, run, baseline, baseline if name.policy.startswith("exact") else None)

    hf_baselines = all(v is None for v in attach.values()) and all(p.input_ids is not None for p in loaded.prompts)
    if hf_baselines:
        out = [System(AUTOREGRESSIVE, hf()),
               System(SystemName("hf-prompt-lookup"), hf(prompt_lookup_num_tokens=10), AUTOREGRESSIVE, AUTOREGRESSIVE)]
    else:  # a model with its own head, or embeddings prompts: Hugging Face generate cannot run it
        out = [System(AUTOREGRESSIVE, echospec("exact-greedy", None, 0, 1))]
    if spec.sweeps or any(p != "exact-greedy" for p in spec.policies):
        out.append(System(AR_SAMPLING, echospec("exact-sampling", None, 0, 1)))
    out += [judged(SystemName(policy, store), echospec(policy, store)) for policy in spec.policies
            for store in spec.stores]
    out += [System(SystemName(policy, first, ((knob, value),)), echospec(policy, first, settings=settings),
                   AR_SAMPLING) for policy, knob, value, settings in swept_settings(spec.sweeps, relaxed)]
    default_sweep = ["exact-sampling" if "exact-sampling" in spec.policies else spec.policies[0]]
    out += [judged(SystemName(policy, first, budget=(nodes, depth)), echospec(policy, first, nodes, depth))
            for policy in spec.sweep_policies or default_sweep for nodes in spec.sweep_nodes
            for depth in spec.sweep_depths if (nodes, depth) != (spec.max_nodes, spec.max_depth)]
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


def decode(systems: list[System], inputs: Loaded, curve, *, rounds: int, seed: int, tokenizer, attach: dict,
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
