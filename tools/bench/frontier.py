"""The speed-quality frontier of the relaxed policies, and the default it chooses for each.

`bench --sweep tau=10,20,40 --sweep beta=0.1,0.2 --sweep threshold=0.3,0.5` runs one system per setting of the
policies each knob sets (`KNOBS`), beside autoregressive sampling, the baseline of every point. Each point's
speed-up is set against every quality measure: WER, SIM and MOS on audio, the target's log-likelihood and the
log-mel DTW distortion to the reference, paired by utterance with the same baseline.

The rule (`choose`): a setting is *inside* when its mean of each measure lies inside the baseline's 95%
interval of that measure, and its log-likelihood within +-5% of the baseline's; the default is the fastest
setting inside that is at least `MIN_SPEEDUP` faster. Where none is, the frontier says so, so that a default that
trades quality silently is never kept.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .harness import POLICIES, BenchError, pyplot, save_figure
from .spec import SystemName

KNOBS = {"tau": (("filtered", "tau", int),), "beta": (("tolerance", "beta", float),),
         "threshold": (("similarity", "similarity", float), ("pcg", "similarity", float))}
"""Each knob: the policies it sets, as (bench policy name, RelaxedSettings field, type)."""
BASELINE = "ar-sampling"
LOG_LIKELIHOOD_BOUND = 0.05
MIN_SPEEDUP = 1.1
MEASURES = {  # name: (label, kind) — "score": the system's mean against the baseline's interval
    "wer": ("WER (%)", "score"), "sim": ("SIM (speaker cosine)", "score"), "mos": ("MOS (DNSMOS P.808)", "score"),
    "log_likelihood": ("log-likelihood change (%)", "relative"),
    "mel_distortion": ("log-mel DTW distortion", "score"),
}


def parse_sweep(text: str) -> tuple[str, tuple]:
    """"tau=10,20,40" -> ("tau", (10, 20, 40)); BenchError naming the knobs on anything else."""
    knob, _, values = text.partition("=")
    knob = knob.strip()
    if knob not in KNOBS or not values.strip():
        raise BenchError(f"--sweep {text!r}: expected KNOB=V1,V2,... with KNOB one of {', '.join(KNOBS)} "
                         "(tau: filtered, beta: tolerance, threshold: similarity and pcg)")
    kind = KNOBS[knob][0][2]
    try:
        parsed = tuple(kind(v) for v in values.split(",") if v.strip())
    except ValueError:
        raise BenchError(f"--sweep {text!r}: {knob} takes {kind.__name__} values") from None
    return knob, parsed


def swept_settings(sweeps: dict, relaxed):
    """(policy, knob, value, settings) for every setting swept, for the policies this bench knows."""
    for knob, values in sweeps.items():
        for policy, field, kind in KNOBS[knob]:
            if policy in POLICIES:
                for value in values:
                    yield policy, knob, kind(value), dataclasses.replace(relaxed, **{field: kind(value)})


def _measure(entry: dict, baseline: dict, measure: str) -> dict | None:
    """One point's measure: its value, its paired change with interval, the baseline's band, inside or not."""
    if MEASURES[measure][1] == "relative":
        change = entry.get("relative_change", {}).get(measure)
        if not change:
            return None
        return {"value": 100 * change["mean"], "change": change["mean"], "change_ci95": change["ci95"],
                "band": [-100 * LOG_LIKELIHOOD_BOUND, 100 * LOG_LIKELIHOOD_BOUND],
                "inside": abs(change["mean"]) <= LOG_LIKELIHOOD_BOUND}
    own, base = entry.get(measure), baseline.get(measure)
    if not own or not base:
        return None
    change = (entry.get(f"{measure}_change") or entry.get("relative_change", {}).get(measure) or {})
    low, high = base["ci95"]
    return {"value": own["mean"], "change": change.get("mean"), "change_ci95": change.get("ci95"),
            "band": [low, high], "inside": low <= own["mean"] <= high}


def frontier(report: dict) -> dict:
    """Every swept point (and each policy's default setting, where it ran) with its speed-up and measures
    against ar-sampling; the setting `choose` picks per policy; ExactSampling's lossless check."""
    systems = report["systems"]
    if BASELINE not in systems:
        raise BenchError("the frontier needs the ar-sampling baseline")
    baseline = systems[BASELINE]
    names = {name: SystemName.parse(name) for name in systems}
    store = next(n.store for n in names.values() if n.settings)
    relaxed = report["setup"]["relaxed"]
    policies = {}
    for knob in report["setup"]["sweeps"]:
        for policy, field, _ in KNOBS[knob]:
            swept = [name for name, n in names.items()
                     if (n.policy, n.store) == (policy, store) and n.settings and n.settings[0][0] == knob]
            if not swept:
                continue
            default = str(SystemName(policy, store))
            points = []
            for name in swept + ([default] if default in systems else []):
                entry = systems[name]
                settings = names[name].settings
                setting = (str(settings[0][1]) if settings
                           else "class default" if relaxed.get(field) is None else str(relaxed.get(field)))
                measures = {m: _measure(entry, baseline, m) for m in MEASURES}
                measures = {m: v for m, v in measures.items() if v is not None}
                points.append({"system": name, "setting": setting, "default": not settings,
                               "speedup": entry["speedup"],
                               "speedup_ci95": entry["speedup_ci95"], "speedup_paired": entry["speedup_paired"],
                               "tokens_per_forward": entry["tokens_per_forward"], "measures": measures,
                               "inside": all(v["inside"] for v in measures.values())})
            policies[policy] = {"knob": knob, "points": points} | choose(points, list(MEASURES))
    lossless = {name: {"identical_to_baseline": s.get("identical_to_baseline"),
                       "changes": {m: _measure(s, baseline, m) for m in MEASURES}}
                for name, s in systems.items() if names[name].policy == "exact-sampling" and names[name].store}
    return {"baseline": BASELINE, "store": store, "policies": policies, "lossless": lossless,
            "rule": f"fastest setting >= {MIN_SPEEDUP}x whose every measure lies inside the baseline's 95% interval "
                    f"(log-likelihood within +-{100 * LOG_LIKELIHOOD_BOUND:.0f}%)",
            "bands": {m: (baseline.get(m) if MEASURES[m][1] == "score" else None) for m in MEASURES}}


def choose(points: list[dict], measures: list[str]) -> dict:
    """{"chosen": the fastest point inside and >= MIN_SPEEDUP (or None), "note": why, "missing": measures no
    point had}."""
    missing = [m for m in measures if not any(m in p["measures"] for p in points)]
    good = [p for p in points if p["inside"] and p["speedup"] >= MIN_SPEEDUP]
    if not good:
        inside = [p for p in points if p["inside"]]
        note = ("no setting is both inside the baseline's interval on every measure and >= "
                f"{MIN_SPEEDUP}x faster" + (f" (inside but slower: {', '.join(p['setting'] for p in inside)})"
                                            if inside else ""))
        return {"chosen": None, "note": note, "missing": missing}
    best = max(good, key=lambda p: p["speedup"])
    return {"chosen": best["setting"], "note": f"{best['speedup']:.2f}x, inside on every measure",
            "missing": missing}


def format_frontier(result: dict) -> str:
    """The frontier as a table: one row a setting, speed-up and each measure (x: outside the baseline's band)."""
    lines = [f"Frontier against {result['baseline']} ({result['store']} store); rule: {result['rule']}."]
    header = f"  {'system':34} {'speed-up':>8} {'95% CI':>13}" + "".join(f" {m:>9}" for m in MEASURES) + "  inside"
    for policy, found in result["policies"].items():
        lines += ["", f"{policy} ({found['knob']}): chosen {found['chosen'] or 'none'} — {found['note']}", header]
        for p in found["points"]:
            cells = "".join(f" {_cell(p['measures'].get(m), m):>9}" for m in MEASURES)
            lines.append(f"  {p['system']:34} {p['speedup']:7.2f}x {'[{:.2f}, {:.2f}]'.format(*p['speedup_ci95']):>13}"
                         f"{cells}  {'yes' if p['inside'] else 'no'}")
    bands = result["bands"]
    lines += ["", "baseline's 95% interval: " + "; ".join(
        f"{m} {_cell({'value': b['mean']}, m)} [{', '.join(_cell({'value': v}, m) for v in b['ci95'])}]"
        for m, b in bands.items() if b)]
    for name, check in result["lossless"].items():
        same = check["identical_to_baseline"]
        changes = ", ".join(f"{m} {c['change']:+.4f}" for m, c in check["changes"].items()
                            if c and c.get("change") is not None)
        lines.append(f"lossless check {name}: identical {same if same is None else f'{same:.2f}'}; "
                     f"changes {changes or '-'}")
    lines.append("values: means (WER in %, log-likelihood as % change); x marks a value outside the baseline's band")
    return "\n".join(lines)


def _cell(measure: dict | None, name: str) -> str:
    if measure is None:
        return "-"
    value = measure["value"] * (100 if name == "wer" else 1)
    text = f"{value:+.1f}%" if name == "log_likelihood" else f"{value:.1f}" if name == "wer" else f"{value:.3f}"
    return text + ("" if measure.get("inside", True) else "x")


def plot_frontier(result: dict, path: Path) -> None:
    """One panel a measure: speed-up over ar-sampling against the measure, one line a policy, each point with
    its speed-up interval, the baseline's 95% interval as a grey band (log-likelihood: +-5%)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(MEASURES), figsize=(4.2 * len(MEASURES), 4.6), squeeze=False)
    palette = plt.get_cmap("tab10")
    for ax, (measure, (label, kind)) in zip(axes[0], MEASURES.items()):
        band = result["bands"].get(measure)
        if kind == "relative":
            ax.axvspan(-100 * LOG_LIKELIHOOD_BOUND, 100 * LOG_LIKELIHOOD_BOUND, color="grey", alpha=0.2)
            ax.axvline(0, color="black", linewidth=1)
        elif band:
            scale = 100 if measure == "wer" else 1
            ax.axvspan(scale * band["ci95"][0], scale * band["ci95"][1], color="grey", alpha=0.25,
                       label="ar-sampling 95% interval")
            ax.axvline(scale * band["mean"], color="black", linewidth=1)
        for i, (policy, found) in enumerate(result["policies"].items()):
            points = sorted((p for p in found["points"] if measure in p["measures"]), key=_knob_order)
            scale = 100 if measure == "wer" else 1
            xs = [scale * p["measures"][measure]["value"] for p in points]
            ys = [p["speedup"] for p in points]
            errors = [[p["speedup"] - p["speedup_ci95"][0] for p in points],
                      [p["speedup_ci95"][1] - p["speedup"] for p in points]]
            ax.errorbar(xs, ys, yerr=errors, fmt="o-", color=palette(i % 10), capsize=2, label=policy)
            for x, y, p in zip(xs, ys, points):
                ax.annotate(p["setting"], (x, y), xytext=(3, 3), textcoords="offset points",
                            fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
        ax.axhline(MIN_SPEEDUP, color="tab:red", linewidth=0.8, linestyle="--")
        ax.set(xlabel=label, ylabel="speed-up over ar-sampling", title=measure)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def _knob_order(point: dict) -> float:
    """A point's place on its policy's line: its knob's value (the class default, unknown here, last)."""
    try:
        return float(point["setting"])
    except ValueError:
        return float("inf")


def write_frontier(result: dict, out_dir: Path) -> None:
    """frontier.json, frontier.md and frontier.png in `out_dir`, each written to a temporary file and renamed."""
    import json

    from ...datastore.files import atomic_file

    with atomic_file(out_dir / "frontier.json") as f:
        json.dump(result, f, indent=1)
    with atomic_file(out_dir / "frontier.md") as f:
        f.write("```\n" + format_frontier(result) + "\n```\n")
    plot_frontier(result, out_dir / "frontier.png")
