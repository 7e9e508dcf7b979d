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
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from .files import atomic_file
from .quality import bootstrap_ci, dtw_distance, relative_difference_ci
from .tts_prompt import TTSMeta, encode_prompt

POLICIES = ("exact-greedy", "exact-sampling", "filtered", "tolerance", "similarity")


class BenchError(ValueError):
    """A prompts file, checkpoint or option the benchmark cannot use."""


@dataclass(frozen=True)
class Prompt:
    id: str
    speaker: str | None
    input_ids: list[int]
    reference: list[int] | None


@dataclass
class System:
    """One way of decoding: `run(model, prompt, seed) -> (model ids generated, target forwards, seconds)`."""

    name: str
    baseline: str  # the system this one's speed-up is measured against
    lossless_of: str | None  # a lossless system must reproduce this one (greedy) or match it in distribution
    run: Callable
    accepted: list[int] = field(default_factory=list)


def load_prompts(path, meta: TTSMeta | None, limit: int | None = None) -> list[Prompt]:
    """Prompts from JSONL: `input_ids` (model ids), or `text` + `speaker` for an echospec TTS checkpoint."""
    prompts = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise BenchError(f"cannot read prompts file {path}: {e.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "input_ids" in row:
                ids = [int(t) for t in row["input_ids"]]
            elif meta is not None:
                ids = encode_prompt(meta, row["text"], row["speaker"])
            else:
                raise BenchError(f"{path}:{number}: no input_ids, and the checkpoint has no echospec_tts.json to encode text")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise BenchError(f"{path}:{number}: bad prompt line ({e})") from None
        prompts.append(Prompt(str(row.get("id", number)), row.get("speaker"), ids, row.get("reference_tokens")))
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise BenchError(f"{path} holds no prompts")
    return prompts


PAPER_TAU_SHARE = 512 / 6561
"""The retrieval paper's filtered acceptance used tau = 512 on CosyVoice 2's 6561 speech tokens; the
same share of a smaller vocabulary keeps the rule's strictness comparable."""


@dataclass(frozen=True)
class RelaxedSettings:
    tau: int  # Filtered: accept drafts within the target's top-tau
    beta: float = 0.2  # Tolerance: accept x when r < q(x) + beta
    similarity: float = 0.3  # SimilarityGroups: cosine threshold of a token's group

    @classmethod
    def for_vocabulary(cls, size: int, tau=None, beta=0.2, similarity=0.3) -> "RelaxedSettings":
        return cls(tau or max(1, round(PAPER_TAU_SHARE * size)), beta, similarity)


def make_policy(name: str, seed: int, relaxed: RelaxedSettings):
    from ..decoder import (
        RAS,
        ExactGreedy,
        ExactSampling,
        Filtered,
        SimilarityGroups,
        Tolerance,
    )

    factories = {
        "exact-greedy": lambda: ExactGreedy(),
        "exact-sampling": lambda: ExactSampling(RAS(), seed=seed),
        "filtered": lambda: Filtered(tau=relaxed.tau, sampler=RAS(), seed=seed),
        "tolerance": lambda: Tolerance(beta=relaxed.beta, sampler=RAS(), seed=seed),
        "similarity": lambda: SimilarityGroups(threshold=relaxed.similarity, sampler=RAS(), seed=seed),
    }
    if name not in factories:
        raise BenchError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    return factories[name]()


def _systems(model, retriever, speech, policies, stores, sweep_nodes, sweep_depths, sweep_policies, max_nodes,
             max_depth, max_new_tokens, relaxed: RelaxedSettings) -> list[System]:
    import torch

    from ..decoder import generate

    forwards = [0]
    auto_curves = []
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))

    def hf(**extra):
        def run(prompt, seed):
            forwards[0] = 0
            ids = torch.tensor([prompt.input_ids])
            start = time.perf_counter()
            out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=list(speech.stop_ids),
                                 pad_token_id=speech.stop_ids[0], attention_mask=torch.ones_like(ids), **extra)
            seconds = time.perf_counter() - start
            # each step after the prefill verifies no tree; prompt lookup's candidate lengths are not seen
            tree_sizes = None if extra else [0] * (forwards[0] - 1)
            return out[0, len(prompt.input_ids):].tolist(), forwards[0], seconds, [], tree_sizes
        return run

    def echospec(policy, store, nodes, depth):
        def run(prompt, seed):
            result = generate(model, retriever if store else None, input_ids=prompt.input_ids,
                              policy=make_policy(policy, seed, relaxed), speech=speech,
                              speaker=prompt.speaker if store == "speaker" else None,
                              max_new_tokens=max_new_tokens, max_nodes=nodes, max_depth=depth)
            stats = result.stats
            if nodes == "auto" and stats.cost_curve:
                auto_curves.append(stats.cost_curve)
            return result.tokens, stats.target_forwards, stats.wall_seconds, stats.accepted_lengths, stats.node_budgets
        return run

    systems = [
        System("autoregressive", "autoregressive", None, hf()),
        System("hf-prompt-lookup", "autoregressive", "autoregressive", hf(prompt_lookup_num_tokens=10)),
    ]
    if any(p != "exact-greedy" for p in policies):
        systems.append(System("ar-sampling", "ar-sampling", None, echospec("exact-sampling", None, 0, 1)))
    for policy in policies:
        greedy = policy == "exact-greedy"
        baseline = "autoregressive" if greedy else "ar-sampling"
        lossless = baseline if policy.startswith("exact") else None
        for store in stores:
            systems.append(System(f"{policy}/{store}", baseline, lossless, echospec(policy, store, max_nodes, max_depth)))
    for policy in sweep_policies or ["exact-sampling" if "exact-sampling" in policies else policies[0]]:
        baseline = "autoregressive" if policy == "exact-greedy" else "ar-sampling"
        lossless = baseline if policy.startswith("exact") else None
        for nodes in sweep_nodes:
            for depth in sweep_depths:
                if (nodes, depth) != (max_nodes, max_depth):
                    name = f"{policy}/{stores[0]}/n{nodes}d{depth}"
                    systems.append(System(name, baseline, lossless, echospec(policy, stores[0], nodes, depth)))
    return systems, auto_curves


def verify_cost_curve(model, speech, prompts: list[Prompt], largest: int, context: int = 150):
    """This machine's forward time against tree size for `model`, relative to a one-token step.

    Measured mid-utterance (the prompt plus up to `context` tokens of its reference speech), since a tree
    forward's cost grows with the context faster than a one-token step's. Returns (curve, context length).
    """
    from ..decoder import ExactGreedy, SpeculativeSession
    from ..decoder.cost import CURVE_SIZES

    prompt = max(prompts, key=lambda p: len(p.reference or ()))
    ids = prompt.input_ids + speech.to_model((prompt.reference or [])[:context])
    session = SpeculativeSession(model, None, ExactGreedy(), speech=speech, max_new_tokens=1)
    session.prefill(input_ids=ids)
    sizes = sorted({s for s in CURVE_SIZES if s < largest} | {largest})
    return session.measure_cost_curve(sizes, repeats=20), len(ids)


def bench(checkpoint, store, prompts_path, *, tokenizer=None, policies=POLICIES, stores=("speaker", "general"),
          max_nodes: int | str = 16, max_depth: int = 8, sweep_nodes=(), sweep_depths=(), sweep_policies=(),
          limit: int | None = None,
          max_new_tokens: int = 400, threads: int = 1, seed: int = 0, tau: int | None = None, beta: float = 0.2,
          similarity: float = 0.3, out_dir=None, progress: bool = True) -> dict:
    """Decode `prompts_path` with every system; return (and write to `out_dir`) the report as a dict."""
    import torch
    from tqdm import tqdm

    from ..decoder import SpeechVocab
    from ..decoder.scoring import mean_log_likelihood
    from ..decoder.cost import node_cap
    from ..retriever import Retriever
    from .speech_tokenizer import SpeechTokenizer
    from .tts_prompt import META_FILE, load_sample_tts

    unknown = set(sweep_policies) - set(policies)
    if unknown:
        raise BenchError(f"sweep policies {', '.join(sorted(unknown))} are not among the benchmarked policies")
    torch.set_num_threads(threads)
    if not (Path(checkpoint) / META_FILE).exists():
        raise BenchError(f"{checkpoint} has no {META_FILE}: echospec bench needs an echospec TTS checkpoint")
    model, meta = load_sample_tts(checkpoint)
    speech = SpeechVocab(meta.speech_offset, meta.speech_vocab_size, (meta.stop_id,))
    prompts = load_prompts(prompts_path, meta, limit)
    retriever = Retriever(store)
    mel = SpeechTokenizer.load(tokenizer).tokens_to_logmel if tokenizer else None
    relaxed = RelaxedSettings.for_vocabulary(speech.size, tau, beta, similarity)
    systems, auto_curves = _systems(model, retriever, speech, list(policies), list(stores), sweep_nodes, sweep_depths,
                       list(sweep_policies), max_nodes, max_depth, max_new_tokens, relaxed)

    for system in systems:  # warm-up: first calls pay for lazy initialisation and numba compilation
        system.run(prompts[0], seed)
    curve, curve_context = verify_cost_curve(model, speech, prompts, max(node_cap(n) for n in [max_nodes, *sweep_nodes]))
    rows = {s.name: [] for s in systems}
    for i, prompt in enumerate(tqdm(prompts, desc="bench", unit="utt", disable=not progress)):
        order = systems[i % len(systems):] + systems[: i % len(systems)]
        for system in order:
            tokens, forwards, seconds, accepted, tree_sizes = system.run(prompt, seed + i)
            system.accepted.extend(accepted)
            speech_tokens = speech.to_local(tokens)
            rows[system.name].append({
                "prompt": prompt.id, "tokens": tokens, "new_tokens": len(tokens), "forwards": forwards,
                "seconds": seconds, "time_per_token": seconds / max(len(tokens), 1),
                # the prefill, then each step's forward in one-token-step units of this machine's curve
                "forward_cost": (None if tree_sizes is None
                                 else 1 + float(np.sum(curve.time(tree_sizes))) / curve.seconds[0]),
                "log_likelihood": mean_log_likelihood(model, prompt.input_ids, tokens),
                "mel_distortion": (dtw_distance(mel(speech_tokens), mel(prompt.reference))
                                   if mel is not None and prompt.reference and speech_tokens else None),
            })
    report = summarise(systems, rows, token_rate=meta.frame_rate)
    report["machine"] = {"threads": threads, "torch": torch.__version__, "cpus": os.cpu_count()}
    report["verify_cost_curve"] = curve.to_dict() | {"context_tokens": curve_context}
    report["auto_cost_curve"] = auto_curves[-1] if auto_curves else None  # what max_nodes="auto" measured
    report["setup"] = {"checkpoint": str(checkpoint), "store": str(store), "prompts": str(prompts_path),
                       "utterances": len(prompts), "max_nodes": max_nodes, "max_depth": max_depth, "seed": seed,
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
        tpt = [r["time_per_token"] for r in runs]
        entry = {
            "baseline": system.baseline,
            "tokens_per_forward": sum(r["new_tokens"] for r in runs) / max(sum(r["forwards"] for r in runs), 1),
            "time_per_token_ms": {"median": 1e3 * median_tpt[system.name], "min": 1e3 * min(tpt), "max": 1e3 * max(tpt)},
            "speedup": median_tpt[system.baseline] / median_tpt[system.name],
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
        summary[system.name] = entry
    return {"systems": summary, "utterances": rows}


def format_table(report: dict) -> str:
    """One row per system; quality changes are relative to the system's baseline, with 95% intervals."""

    def change(entry, measure):
        ci = entry.get("relative_change", {}).get(measure)
        return f"{100 * ci['mean']:+5.1f}% [{100 * ci['ci95'][0]:+5.1f},{100 * ci['ci95'][1]:+5.1f}]" if ci else "-"

    header = (f"{'system':32} {'tok/fwd':>7} {'TPT ms':>7} {'speed-up':>8} {'fwd-cost':>8} {'LM RTF':>6} {'log-lik':>7} "
              f"{'vs baseline':>21} {'mel-DTW':>7} {'vs baseline':>21} {'same':>5}")
    lines = [header, "-" * len(header)]
    for name, s in report["systems"].items():
        mel = s["mel_distortion"]
        same = s.get("identical_to_baseline")
        predicted = s.get("forward_cost_speedup")
        lines.append(
            f"{name:32} {s['tokens_per_forward']:7.2f} {s['time_per_token_ms']['median']:7.2f} {s['speedup']:7.2f}x "
            f"{'-' if predicted is None else f'{predicted:.2f}x':>8} "
            f"{s['lm_rtf']:6.3f} {s['log_likelihood']['mean']:7.3f} {change(s, 'log_likelihood'):>21} "
            f"{mel['mean'] if mel else float('nan'):7.2f} {change(s, 'mel_distortion'):>21} "
            f"{'-' if same is None else f'{same:.2f}':>5}")
    curve = report.get("verify_cost_curve")
    if curve:
        points = ", ".join(f"{n}: {r:.2f}" for n, r in zip(curve["sizes"], curve["relative"]))
        lines += ["",
                  (f"verify-cost curve (tree nodes: forward time / one-token step, {curve['context_tokens']}-token "
                   f"context): {points}"),
                  ("fwd-cost: the speed-up this curve predicts from the steps' tree sizes alone; tok/fwd: the speed-up "
                   "where a tree forward costs one step")]
    return "\n".join(lines)


def write_report(report: dict, systems: list[System], out_dir: Path) -> None:
    """bench.json, bench.md and bench.png in `out_dir`, each written to a temporary file and renamed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_file(out_dir / "bench.json") as f:
        json.dump(report, f, indent=1)
    with atomic_file(out_dir / "bench.md") as f:
        f.write("```\n" + format_table(report) + "\n```\n")
    plot(report, systems, out_dir / "bench.png")


def plot(report: dict, systems: list[System], path: Path) -> None:
    """Accepted tree nodes per step for each echospec system; speed-up against quality; the verify-cost curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, cost) = plt.subplots(1, 3, figsize=(19, 5.5), gridspec_kw={"width_ratios": [3, 3, 2]})
    colors = plt.get_cmap("tab20")
    for i, system in enumerate(systems):
        color = colors(i % 20)
        if system.accepted and system.name not in ("autoregressive", "ar-sampling"):
            counts = np.bincount(system.accepted)
            left.plot(np.arange(len(counts)), counts / counts.sum(), marker="o", color=color, label=system.name)
        s = report["systems"][system.name]
        ll = s["log_likelihood"]
        right.errorbar(s["speedup"], ll["mean"], yerr=[[ll["mean"] - ll["ci95"][0]], [ll["ci95"][1] - ll["mean"]]],
                       fmt="o", capsize=3, color=color, label=system.name)
    left.set(xlabel="tree nodes accepted in a step", ylabel="share of steps", title="Accepted lengths")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    right.set(xlabel="speed-up over its baseline (median time per token)",
              ylabel="target mean log-likelihood (95% CI)", title="Speed against quality")
    curve = report.get("verify_cost_curve")
    if curve:
        cost.plot(curve["sizes"], curve["relative"], marker="o", label="this machine")
        cost.axhline(1.0, color="grey", linestyle="--", label="flat (a GPU, roughly)")
        cost.legend(fontsize=7)
    cost.set(xlabel="tree nodes verified", ylabel="forward time / one-token step", title="Verify-cost curve")
    fig.tight_layout()
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
