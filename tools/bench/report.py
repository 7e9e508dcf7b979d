"""Reporting a bench: the per-system summary (speed-ups, quality intervals, identity with the baseline), the
table printed and written to bench.md, bench.json and the plot bench.png."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np

from ...datastore.files import atomic_file
from .audio import has_audio_scores, paper_table
from .frontier import write_frontier
from .harness import System, pyplot, save_figure
from .quality import bootstrap_ci, median_ratio_ci, ratio_of_medians_ci, relative_difference_ci
from .spec import SystemName


def summarise(systems: list[System], rows: dict, token_rate: float) -> dict:
    """Per-system medians, ratios to the baseline, tokens per forward and quality intervals; `rows` and the
    systems are keyed by SystemName, the report (a JSON record) by its printed name."""
    median_tpt = {name: float(np.median([r["time_per_token"] for r in runs])) for name, runs in rows.items()}
    tokens_per_cost = {name: sum(r["new_tokens"] for r in runs) / sum(r["forward_cost"] for r in runs)
                       for name, runs in rows.items() if all(r["forward_cost"] is not None for r in runs)}
    summary = {}
    for system in systems:
        runs = rows[system.name]
        tpt, base_tpt = [r["time_per_token"] for r in runs], [r["time_per_token"] for r in rows[system.baseline]]
        entry = {
            "baseline": str(system.baseline),
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
        if all(r.get("accept_seconds") is not None for r in runs):
            seconds = sum(r["seconds"] for r in runs)
            entry["accept_share"] = sum(r["accept_seconds"] for r in runs) / max(seconds, 1e-12)
            # what a step costs beyond its forward: the retriever, the mask, the walk, the cache's compaction
            entry["step_overhead_ms"] = 1e3 * (seconds - sum(r["forward_seconds"] for r in runs)) / max(
                sum(r["forwards"] for r in runs), 1)
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
        summary[str(system.name)] = entry
    return {"systems": summary, "utterances": {str(name): runs for name, runs in rows.items()}}


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
        fixed = {f"n{other.budget[0]}d{other.budget[1]}": median_ratio_ci([r["time_per_token"] for r in rows[other]],
                                                                           auto).to_dict("median")
                 for other in rows if other.budget and other.with_budget(0, 0) == name.with_budget(0, 0)}
        if fixed:
            compared[str(name)] = fixed
    return compared


WIDTH = 100  # the short table and its notes fit a terminal this wide


def format_table(report: dict, full: bool = False) -> str:
    """The headline, then one row per system, grouped by the baseline its speed and quality are measured
    against. Short (the default): speed-up, tokens per forward, quality change and identity, in WIDTH
    columns; `full`: every measure with its 95% interval (what bench.md holds)."""
    notes = [headline(report), ""]
    notes += _full_table(report) if full else _short_table(report)
    notes += _auto_notes(report, full)
    if has_audio_scores(report):
        notes += ["", paper_table(report, full, [n for n in report["systems"] if not SystemName.parse(n).settings])]
    if "frontier" in report:
        notes += ["", "Frontier (frontier.md has every setting): " + report["frontier"]["rule"]]
        notes += [f"  {policy} ({found['knob']}): {found['chosen'] or 'none'} — {found['note']}"
                  for policy, found in report["frontier"]["policies"].items()]
    return "\n".join(notes)


def headline(report: dict) -> str:
    """How much faster the fastest lossless system ran than its baseline, and whether its output was the
    baseline's (greedy if it ran, else sampling); on a second line, which system that was."""
    systems = report["systems"]
    for kind, baseline in (("greedy", "autoregressive"), ("sampling", "ar-sampling")):
        lossless = [name for name, s in systems.items()
                    if s.get("identical_to_baseline") is not None and s["baseline"] == baseline
                    and name != "hf-prompt-lookup"]
        if lossless:
            name = max(lossless, key=lambda n: systems[n]["speedup"])
            s = systems[name]
            utterances = len(report["utterances"][name])
            same = round(s["identical_to_baseline"] * utterances)
            speed = (f"{s['speedup']:.2f}x faster than {baseline}" if s["speedup"] >= 1
                     else f"{s['speedup']:.2f}x the speed of {baseline} (slower)")
            return (f"Lossless {kind}: {speed}, identical output in {same}/{utterances} utterances\n"
                    f"({name}; every figure below is against the baseline its group names)")
    return "No lossless system ran; every figure below is against the baseline its group names"


def _groups(report: dict) -> list[tuple[str, list[str]]]:
    """(title, system names) per baseline: greedy systems against autoregressive, sampling ones against ar-sampling."""
    names = list(report["systems"])
    greedy_baseline = ("Hugging Face generate" if "hf-prompt-lookup" in names else "echospec's own loop")
    titles = {"autoregressive": f"Greedy, against autoregressive ({greedy_baseline}):",
              "ar-sampling": "Sampling, against ar-sampling (autoregressive sampling with the same sampler):"}
    groups = []
    for baseline, title in titles.items():
        members = [n for n in names if report["systems"][n]["baseline"] == baseline]
        if members:
            groups.append((title, members))
    return groups


def _change(entry: dict, measure: str, interval: bool = False) -> str:
    ci = entry.get("relative_change", {}).get(measure)
    if not ci:
        return "-"
    mean = f"{100 * ci['mean']:+5.1f}%"
    return f"{mean} [{100 * ci['ci95'][0]:+5.1f},{100 * ci['ci95'][1]:+5.1f}]" if interval else mean


def _short_table(report: dict) -> list[str]:
    header = (f"  {'system':30} {'speed-up':>8} {'95% CI':>13} {'tok/fwd':>7} {'log-lik':>8} {'mel-DTW':>8} "
              f"{'same':>5}")
    lines = []
    for title, names in _groups(report):
        lines += [title, header]
        for name in names:
            s = report["systems"][name]
            same = s.get("identical_to_baseline")
            lines.append(f"  {name:30} {s['speedup']:7.2f}x {'[{:.2f}, {:.2f}]'.format(*s['speedup_ci95']):>13} "
                         f"{s['tokens_per_forward']:7.2f} {_change(s, 'log_likelihood'):>8} "
                         f"{_change(s, 'mel_distortion'):>8} {'-' if same is None else f'{same:.2f}':>5}")
        lines.append("")
    return lines + _wrapped(
        "speed-up: the baseline's median time per token over the system's, with its 95% interval; tok/fwd: "
        "tokens per target forward; log-lik, mel-DTW: mean change against the baseline of the target's "
        "log-likelihood and of the log-mel distortion to the reference; same: share of utterances token for "
        "token the baseline's. --full (and bench.md): time per token, paired ratios, the verify-cost "
        "prediction, real-time factor, intervals and logit differences.")


def _full_table(report: dict) -> list[str]:
    header = (f"{'system':32} {'tok/fwd':>7} {'TPT ms':>7} {'speed-up':>8} {'95% CI':>13} {'paired':>7} {'fwd-cost':>8} "
              f"{'LM RTF':>6} {'log-lik':>7} {'vs baseline':>21} {'mel-DTW':>7} {'vs baseline':>21} {'same':>5} {'max dlogit':>10}")
    lines = []
    for title, names in _groups(report):
        lines += [title, header, "-" * len(header)]
        for name in names:
            s = report["systems"][name]
            mel = s["mel_distortion"]
            same = s.get("identical_to_baseline")
            predicted = s.get("forward_cost_speedup")
            lines.append(
                f"{name:32} {s['tokens_per_forward']:7.2f} {s['time_per_token_ms']['median']:7.2f} {s['speedup']:7.2f}x "
                f"{'[{:.2f}, {:.2f}]'.format(*s['speedup_ci95']):>13} {s['speedup_paired']['median']:6.2f}x "
                f"{'-' if predicted is None else f'{predicted:.2f}x':>8} "
                f"{s['lm_rtf']:6.3f} {s['log_likelihood']['mean']:7.3f} {_change(s, 'log_likelihood', True):>21} "
                f"{mel['mean'] if mel else float('nan'):7.2f} {_change(s, 'mel_distortion', True):>21} "
                f"{'-' if same is None else f'{same:.2f}':>5} {_largest_difference(s):>10}")
        lines.append("")
    lines += ["speed-up: the baseline's median time per token over the system's; paired: the median over utterances "
              "of each one's ratio (prompt, length and the machine's state of the moment cancel)",
              "same: share of utterances token for token the baseline's; max dlogit: over the others, the largest "
              "logit difference at the first divergent token between the system's forward and a plain one-token "
              "forward (rounding flips near-ties at ~1e-6 in float32, ~1e-2 in bfloat16; a bug shows far larger)"]
    curve = report.get("verify_cost_curve")
    if curve:
        points = ", ".join(f"{n}: {r:.2f}" for n, r in zip(curve["sizes"], curve["relative"]))
        lines += ["",
                  (f"verify-cost curve (tree nodes: forward time / one-token step, {curve['context_tokens']}-token "
                   f"context): {points}"),
                  ("fwd-cost: the speed-up this curve predicts from the steps' tree sizes alone; tok/fwd: the speed-up "
                   "where a tree forward costs one step")]
    return lines


def _auto_notes(report: dict, full: bool) -> list[str]:
    """What the "auto" node budget's figures mean over this run, and how it fared against the fixed budgets
    swept beside it."""
    from ...decoder.budget import CAPS, NODES, TRIES

    settle = len(CAPS) * TRIES  # utterances before an adaptive budget chooses by its rates

    wrap = (lambda text: [text]) if full else _wrapped
    lines = []
    setup = report.get("setup", {})
    utterances = setup.get("utterances")
    if setup.get("max_nodes") == "auto" and utterances is not None and utterances < 4 * settle:
        lines += [""] + wrap(f"auto (the node budget): each system's first {settle} utterances measure its caps, so "
                             f"over {utterances} its figures are mostly that measuring, not the cap it settles on; "
                             f"run more prompts or --rounds, or pin a budget (--max-nodes {NODES})")
    against = report.get("auto_against_fixed")
    if against:
        lines += [""] + wrap("auto against the fixed budgets swept beside it (paired: each utterance's time per "
                             "token under the budget over auto's, median and 95% interval; below 1 with its whole "
                             "interval, pinning that budget was faster):")
        lines += [f"  {name}: " + ", ".join(f"{budget} {r['median']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"
                                            for budget, r in fixed.items()) for name, fixed in against.items()]
    return lines


def _wrapped(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH)


def _largest_difference(entry: dict) -> str:
    differences = [d["max_logit_difference"] for d in entry.get("divergences", ())
                   if d.get("max_logit_difference") is not None]
    if "divergences" not in entry:
        return "-"
    return f"{max(differences):.1e}" if differences else ("0" if not entry["divergences"] else "?")


def write_report(report: dict, out_dir: Path) -> None:
    """bench.json, bench.md (the full table) and bench.png in `out_dir`, each written to a temporary file and
    renamed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_file(out_dir / "bench.json") as f:
        json.dump(report, f, indent=1)
    with atomic_file(out_dir / "bench.md") as f:
        f.write("```\n" + format_table(report, full=True) + "\n```\n")
    plot(report, out_dir / "bench.png")
    if "frontier" in report:
        write_frontier(report["frontier"], out_dir, report["setup"])


BASELINES = {"autoregressive": ("greedy, against autoregressive", "tab:blue"),
             "ar-sampling": ("sampling, against ar-sampling", "tab:orange")}


def plot(report: dict, path: Path) -> None:
    """Each system's speed-up over its baseline; the sampling systems' speed against their quality; where
    max_nodes="auto" ran, the share of steps it gave each cap."""
    plt = pyplot()
    # rows without caps (a report from before they were recorded) are left out
    auto = {name: runs for name, runs in report["utterances"].items() if any("caps" in run for run in runs)}
    sampling = [name for name, s in report["systems"].items() if s["baseline"] == "ar-sampling" != name]
    panels = 1 + bool(sampling) + bool(auto)
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 5.5), squeeze=False)
    axes = list(axes[0])
    plot_speedups(axes.pop(0), report["systems"])
    if sampling:
        plot_speed_against_quality(axes.pop(0), {name: report["systems"][name] for name in sampling})
    if auto:
        plot_auto_caps(axes.pop(0), auto)
    fig.tight_layout()
    save_figure(fig, path)


def plot_speedups(ax, systems: dict) -> None:
    """One bar per system (the baselines left out): its speed-up over its own baseline, with the 95% interval,
    coloured by that baseline."""
    rows = [(name, s) for name, s in systems.items() if s["baseline"] != name]
    for y, (name, s) in enumerate(rows):
        low, high = s["speedup_ci95"]
        ax.barh(y, s["speedup"], color=BASELINES.get(s["baseline"], ("", "tab:grey"))[1], alpha=0.8)
        ax.errorbar(s["speedup"], y, xerr=[[s["speedup"] - low], [high - s["speedup"]]], color="black", capsize=3)
        ax.annotate(f"{s['speedup']:.2f}x", (high, y), xytext=(4, 0), textcoords="offset points", va="center",
                    fontsize=8)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(rows)), [name for name, _ in rows], fontsize=8)
    ax.invert_yaxis()
    handles = [plt_patch(color, label) for baseline, (label, color) in BASELINES.items()
               if any(s["baseline"] == baseline for _, s in rows)]
    ax.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    ax.set(xlabel="speed-up over its baseline (median time per token, 95% interval)", title="Speed-up")


def plot_speed_against_quality(ax, systems: dict) -> None:
    """The sampling systems' speed-up over autoregressive sampling against the change of the target's mean
    log-likelihood, each with its 95% interval; a lossless system sits on the zero line."""
    palette = pyplot().get_cmap("tab10")
    names = {name: SystemName.parse(name) for name in systems}
    policies = list(dict.fromkeys(n.policy for n in names.values()))  # one colour a policy, one marker the rest
    rest = {name: str(n)[len(n.policy) + 1:] for name, n in names.items()}
    markers = dict(zip(dict.fromkeys(rest.values()), "osD^v<>"))
    for name, s in systems.items():
        change = s.get("relative_change", {}).get("log_likelihood")
        if change is None:
            continue
        mean, (c_low, c_high) = 100 * change["mean"], [100 * c for c in change["ci95"]]
        low, high = s["speedup_ci95"]
        ax.errorbar(s["speedup"], mean, xerr=[[s["speedup"] - low], [high - s["speedup"]]],
                    yerr=[[mean - c_low], [c_high - mean]], fmt=markers.get(rest[name], "o"), capsize=3,
                    color=palette(policies.index(names[name].policy) % 10), label=name)
    ax.axhline(0.0, color="black", linewidth=1)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    ax.set(xlabel="speed-up over ar-sampling (95% interval)",
           ylabel="change of the target's mean log-likelihood (%)",
           title="Sampling systems against ar-sampling: speed and quality")


def plot_auto_caps(ax, auto: dict) -> None:
    """One bar per "auto" system: the share of its steps run under each node cap (0: plain steps)."""
    caps = {name: np.array([cap for run in runs for cap in run.get("caps", ())]) for name, runs in auto.items()}
    values = sorted({int(c) for steps in caps.values() for c in steps})
    palette = pyplot().get_cmap("viridis")
    names = list(caps)
    left = np.zeros(len(names))
    for i, value in enumerate(values):
        shares = np.array([np.mean(caps[n] == value) if len(caps[n]) else 0.0 for n in names])
        ax.barh(range(len(names)), shares, left=left, color=palette(i / max(len(values) - 1, 1)),
                label="plain steps" if value == 0 else f"{value} nodes")
        left += shares
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlim=(0, 1), xlabel="share of its steps", title='max_nodes="auto": the caps it ran')
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=min(len(values), 6))


def plt_patch(color: str, label: str):
    """A legend entry: a filled square of `color`."""
    from matplotlib.patches import Patch

    return Patch(color=color, label=label)
