"""Reporting a bench: the per-system summary (speed-ups, quality intervals, identity with the baseline), the
table printed and written to bench.md, bench.json and the plot bench.png."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ...datastore.files import atomic_file
from .harness import System, plot_cost_curve, pyplot, save_figure
from .quality import bootstrap_ci, median_ratio_ci, ratio_of_medians_ci, relative_difference_ci


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
