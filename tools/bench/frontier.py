"""The speed-quality frontier of the relaxed policies, and the setting it chooses for each: a rule that can refuse.

`bench --sweep tau=10,20,40 --sweep beta=0.1,0.2 --sweep threshold=0.3,0.5` runs one system per setting of the
policies each knob sets (decoder.registry), beside autoregressive sampling, the baseline of every point.

The rule (`judge`, `choose`): the prompts are split in two halves by a hash of their ids (`split_prompts`: the same
prompt falls in the same half in every run and in every round). On the *choosing* half, each measure's change
against the baseline is taken paired by utterance with its 95% bootstrap interval, and a setting passes when, for
every measure, the interval's bound on the side of harm stays within the measure's margin (`MARGINS`):

    WER             +2 points (the fraction +0.02): a word in fifty more mis-heard is audible; less is noise on
                    the ears the bench has
    SIM             -1 point of speaker cosine x100 (-0.01): the spread between sentences of one voice is wider
    MOS             -0.05: a tenth of DNSMOS's own run-to-run spread on the sample's audio
    log-likelihood  +-5% relative, both ways: a rise is mode-seeking (monotone speech), a fall is off-distribution
    mel-DTW         +5% relative: distortion to the reference grows with audible artefacts

A measure that was not scored, or that failed on an utterance where the baseline has it, is *unmeasured*: the
setting is refused, never passed. The chosen setting is the fastest passing one at least `MIN_SPEEDUP` faster on
the choosing half; it is then reported on the other half (`reported`), which took no part in the choice.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from ...decoder import registry
from .harness import POLICIES, BenchError, pyplot, save_figure
from .quality import difference_ci, ratio_of_medians_ci, relative_difference_ci
from .spec import SystemName

BASELINE = "ar-sampling"
MIN_SPEEDUP = 1.1


@dataclasses.dataclass(frozen=True)
class Margin:
    """How far a measure's paired change may go: `harm` +1 (a rise is a loss), -1 (a fall is) or 0 (both are);
    `relative`: the change as a share of the baseline's mean, else in the measure's units."""

    label: str
    harm: int
    margin: float
    relative: bool = False
    scale: float = 1.0  # how the change is printed: WER and SIM in points (x100), relative ones in %


MARGINS = {
    "wer": Margin("WER change (points)", +1, 0.02, scale=100),
    "sim": Margin("SIM change (points)", -1, 0.01, scale=100),
    "mos": Margin("MOS change", -1, 0.05),
    "log_likelihood": Margin("log-likelihood change (%)", 0, 0.05, relative=True, scale=100),
    "mel_distortion": Margin("log-mel DTW change (%)", +1, 0.05, relative=True, scale=100),
}
MEASURES = tuple(MARGINS)


def parse_sweep(text: str) -> tuple[str, tuple]:
    """"tau=10,20,40" -> ("tau", (10, 20, 40)); BenchError naming the knobs on anything else (or out of bounds)."""
    name, _, values = text.partition("=")
    try:
        knob = registry.knob(name.strip())
        if not values.strip():
            raise ValueError("no values")
        policy = registry.policies_of(knob.name)[0]
        parsed = tuple(knob.check(policy, knob.parse(v)) for v in values.split(",") if v.strip())
    except ValueError as e:
        raise BenchError(f"--sweep {text!r}: expected KNOB=V1,V2,...: {e}") from None
    return knob.name, parsed


def swept_settings(sweeps: dict, relaxed):
    """(policy, knob, value, settings) for every setting swept, for the policies this bench knows."""
    for knob, values in sweeps.items():
        for policy in registry.policies_of(knob):
            if policy in POLICIES:
                for value in values:
                    yield policy, knob, value, dataclasses.replace(relaxed, **{knob: value})


def split_prompts(prompt_ids) -> tuple[set, set]:
    """(choosing half, reporting half) of the prompt ids: ranked by a hash of the id, alternately; the same ids
    always split the same way, whatever their order."""
    ranked = sorted(set(prompt_ids), key=lambda p: hashlib.sha256(str(p).encode()).hexdigest())
    return set(ranked[::2]), set(ranked[1::2])


def judge(rows: list[dict], base: list[dict], half: set) -> dict:
    """One system's utterance rows against the baseline's on the prompts in `half`: its speed-up and, per measure,
    the paired change with its 95% interval, the bound on the side of harm, and whether it passes (or why it is
    unmeasured)."""
    by_key = {(b["prompt"], b["round"]): b for b in base}
    pairs = [(r, by_key[(r["prompt"], r["round"])]) for r in rows
             if r["prompt"] in half and (r["prompt"], r["round"]) in by_key]
    if not pairs:
        return {"utterances": 0, "speedup": None, "measures": {m: {"unmeasured": "no utterance in this half"}
                                                              for m in MARGINS}, "passes": False}
    speedup = ratio_of_medians_ci([b["time_per_token"] for _, b in pairs], [r["time_per_token"] for r, _ in pairs])
    measures = {m: _change(pairs, m, margin) for m, margin in MARGINS.items()}
    return {"utterances": len(pairs), "speedup": speedup.mean, "speedup_ci95": [speedup.low, speedup.high],
            "measures": measures, "passes": all(v.get("passes", False) for v in measures.values())}


def _change(pairs: list[tuple[dict, dict]], measure: str, margin: Margin) -> dict:
    """A measure's paired change, its interval and whether its bound on the side of harm is within the margin."""
    scored = [(r.get(measure), b.get(measure)) for r, b in pairs if b.get(measure) is not None]
    failed = sum(value is None for value, _ in scored)
    if not scored or failed:
        why = f"failed on {failed} of {len(scored)} utterances" if failed else "not scored"
        return {"unmeasured": why}
    interval = (relative_difference_ci if margin.relative else difference_ci)(*zip(*scored))
    low, high = interval.low, interval.high
    bound = {+1: high, -1: low, 0: low if abs(low) > abs(high) else high}[margin.harm]
    return {"change": interval.mean, "ci95": [low, high], "bound": bound, "margin": margin.margin,
            "passes": bool(abs(bound) <= margin.margin if margin.harm == 0 else margin.harm * bound <= margin.margin)}


def frontier(report: dict) -> dict:
    """Every swept point (and each policy's default setting, where it ran) judged on the choosing half; the setting
    `choose` picks per policy, reported on the other half; the exact policies judged alike (they must pass)."""
    systems, utterances = report["systems"], report["utterances"]
    if BASELINE not in systems:
        raise BenchError("the frontier needs the ar-sampling baseline")
    base = utterances[BASELINE]
    choosing, reporting = split_prompts(r["prompt"] for r in base)
    names = {name: SystemName.parse(name) for name in systems}
    store = next(n.store for n in names.values() if n.settings)
    relaxed = report["setup"]["relaxed"]
    policies = {}
    for knob in report["setup"]["sweeps"]:
        for policy in registry.policies_of(knob):
            swept = [name for name, n in names.items()
                     if (n.policy, n.store) == (policy, store) and n.settings and n.settings[0][0] == knob]
            if not swept:
                continue
            default = str(SystemName(policy, store))
            points = []
            for name in swept + ([default] if default in systems else []):
                settings = names[name].settings
                value = (settings[0][1] if settings else relaxed.get(knob) if relaxed.get(knob) is not None
                         else registry.default(policy))
                points.append({"system": name, "setting": value, "default": not settings,
                               "tokens_per_forward": systems[name]["tokens_per_forward"]}
                              | judge(utterances[name], base, choosing))
            found = choose(points)
            if found["chosen"] is not None:
                chosen = next(p for p in points if p["setting"] == found["chosen"])
                found["reported"] = judge(utterances[chosen["system"]], base, reporting)
            policies[policy] = {"knob": knob, "points": points} | found
    lossless = {name: {"identical_to_baseline": s.get("identical_to_baseline")}
                | judge(utterances[name], base, choosing | reporting)
                for name, s in systems.items() if names[name].policy == "exact-sampling" and names[name].store}
    return {"baseline": BASELINE, "store": store, "policies": policies, "lossless": lossless,
            "halves": {"choosing": sorted(choosing), "reporting": sorted(reporting)},
            "margins": {m: dataclasses.asdict(margin) for m, margin in MARGINS.items()}, "rule": RULE}


RULE = (f"fastest setting >= {MIN_SPEEDUP}x whose every measure's paired 95% bound on the side of harm stays within "
        "its margin (WER +2 points, SIM -1 point, MOS -0.05, log-likelihood +-5%, log-mel DTW +5%) on the choosing "
        "half of the prompts; an unmeasured measure refuses; reported on the other half")


def choose(points: list[dict]) -> dict:
    """{"chosen": the fastest passing point's setting >= MIN_SPEEDUP (or None), "note": why}."""
    good = [p for p in points if p["passes"] and p["speedup"] >= MIN_SPEEDUP]
    if not good:
        unmeasured = sorted({m for p in points for m, v in p["measures"].items() if "unmeasured" in v})
        passing = [str(p["setting"]) for p in points if p["passes"]]
        note = (f"no setting both passes every measure and is >= {MIN_SPEEDUP}x faster"
                + (f" (passing but slower: {', '.join(passing)})" if passing else "")
                + (f"; unmeasured: {', '.join(unmeasured)}" if unmeasured else ""))
        return {"chosen": None, "note": note}
    best = max(good, key=lambda p: p["speedup"])
    return {"chosen": best["setting"], "note": f"{best['speedup']:.2f}x, within every margin"}


SETTINGS_FILE = "relaxed_settings.json"


def relaxed_settings(result: dict, setup: dict) -> dict:
    """The calibration file (decoder.registry.load_relaxed_settings reads it): each policy's chosen setting, the
    model, store and prompts it was measured on, the rule, the halves, and why the others were refused."""
    chosen = {policy: {found["knob"]: found["chosen"]} for policy, found in result["policies"].items()
              if found["chosen"] is not None}
    refused = {policy: found["note"] for policy, found in result["policies"].items() if found["chosen"] is None}
    return registry.relaxed_settings_record(chosen, model=setup["checkpoint"], store=setup["store"],
                                            prompts=setup["prompts"], path="tree", refused=refused,
                                            rule=result["rule"], halves=result["halves"])


def format_frontier(result: dict) -> str:
    """The frontier as a table: one row a setting, its speed-up and each measure's paired change on the choosing
    half (x: its bound is past the margin; ?: unmeasured); each policy's choice reported on the other half."""
    lines = [f"Frontier against {result['baseline']} ({result['store']} store); rule: {result['rule']}.",
             f"halves: {len(result['halves']['choosing'])} prompts choose, {len(result['halves']['reporting'])} "
             "report"]
    header = f"  {'system':34} {'speed-up':>8}" + "".join(f" {m:>14}" for m in MEASURES) + "  passes"
    for policy, found in result["policies"].items():
        lines += ["", f"{policy} ({found['knob']}): chosen {found['chosen'] or 'none'} — {found['note']}", header]
        lines += [_row(p["system"], p) for p in found["points"]]
        if found.get("reported"):
            lines.append(_row("  reported on the other half", found["reported"]))
    lines += [_row(f"lossless check {name}", check) for name, check in result["lossless"].items()]
    lines.append("changes: paired means on the choosing half (WER, SIM in points; log-likelihood, mel in %); "
                 "x: the 95% bound on the side of harm is past the margin; ?: unmeasured")
    return "\n".join(lines)


def _row(label: str, judged: dict) -> str:
    speed = "-" if judged["speedup"] is None else f"{judged['speedup']:.2f}x"
    cells = "".join(f" {_cell(judged['measures'][m], MARGINS[m]):>14}" for m in MEASURES)
    return f"  {label:34} {speed:>8}{cells}  {'yes' if judged['passes'] else 'no'}"


def _cell(measure: dict, margin: Margin) -> str:
    if "unmeasured" in measure:
        return "?"
    return f"{margin.scale * measure['change']:+.2f}" + ("" if measure["passes"] else "x")


def plot_frontier(result: dict, path: Path) -> None:
    """One panel a measure: speed-up over ar-sampling against the measure's paired change on the choosing half,
    one line a policy, each point with the change's 95% interval; the margin's side of harm outside the grey."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(MARGINS), figsize=(4.2 * len(MARGINS), 4.6), squeeze=False)
    palette = plt.get_cmap("tab10")
    for ax, (measure, margin) in zip(axes[0], MARGINS.items()):
        edge = margin.scale * margin.margin
        low, high = {+1: (-3 * edge, edge), -1: (-edge, 3 * edge), 0: (-edge, edge)}[margin.harm]
        ax.axvspan(low, high, color="grey", alpha=0.2, label="within the margin")
        ax.axvline(0, color="black", linewidth=1)
        for i, (policy, found) in enumerate(result["policies"].items()):
            points = sorted((p for p in found["points"] if "change" in p["measures"][measure]),
                            key=lambda p: float(p["setting"]))
            changes = [p["measures"][measure] for p in points]
            xs = [margin.scale * c["change"] for c in changes]
            errors = [[margin.scale * (c["change"] - c["ci95"][0]) for c in changes],
                      [margin.scale * (c["ci95"][1] - c["change"]) for c in changes]]
            ys = [p["speedup"] for p in points]
            ax.errorbar(xs, ys, xerr=errors, fmt="o-", color=palette(i % 10), capsize=2, label=policy)
            for x, y, p in zip(xs, ys, points):
                ax.annotate(str(p["setting"]), (x, y), xytext=(3, 3), textcoords="offset points", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
        ax.axhline(MIN_SPEEDUP, color="tab:red", linewidth=0.8, linestyle="--")
        ax.set(xlabel=margin.label, ylabel="speed-up over ar-sampling", title=measure)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def write_frontier(result: dict, out_dir: Path, setup: dict) -> None:
    """frontier.json, frontier.md, frontier.png and the calibration file (SETTINGS_FILE) in `out_dir`, each written
    to a temporary file and renamed."""
    import json

    from ...datastore.files import atomic_file

    with atomic_file(out_dir / "frontier.json") as f:
        json.dump(result, f, indent=1)
    with atomic_file(out_dir / "frontier.md") as f:
        f.write("```\n" + format_frontier(result) + "\n```\n")
    with atomic_file(out_dir / SETTINGS_FILE) as f:
        json.dump(relaxed_settings(result, setup), f, indent=1)
    plot_frontier(result, out_dir / "frontier.png")
