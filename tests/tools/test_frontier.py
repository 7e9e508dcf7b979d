"""The frontier's rule: a setting is chosen only when every measure's paired 95% bound on the side of harm stays
within its margin on the choosing half of the prompts; unmeasured refuses; the choice is reported on the other half."""

import json

import numpy as np
import pytest

from echospec.decoder.registry import load_relaxed_settings
from echospec.tools.bench.frontier import (SETTINGS_FILE, choose, format_frontier, frontier, judge, parse_sweep,
                                           plot_frontier, split_prompts, write_frontier)

PROMPTS = [f"p{i}" for i in range(40)]
CHOOSING, REPORTING = split_prompts(PROMPTS)


def _rows(speedup=1.0, damage=None, missing=(), halves=(CHOOSING, REPORTING)):
    """One system's utterance rows: the baseline's scores (noisy per prompt, fixed by the prompt), its time per token
    divided by `speedup`; `damage` ({measure: shift}) added on the prompts of `halves`; `missing` measures None."""
    rng = np.random.default_rng(0)
    rows = []
    for prompt in PROMPTS:
        row = {"prompt": prompt, "round": 0, "time_per_token": (0.01 + 0.002 * rng.random()) / speedup,
               "wer": 0.3 + 0.1 * rng.random(), "sim": 0.9 + 0.05 * rng.random(), "mos": 3 + rng.random(),
               "log_likelihood": -5 - rng.random(), "mel_distortion": 20 + rng.random()}
        if any(prompt in half for half in halves):
            row |= {m: row[m] + shift for m, shift in (damage or {}).items()}
        rows.append(row | {m: None for m in missing})
    return rows


def _report(**systems):
    """A bench report with the baseline and one tau setting per keyword (t40=rows -> filtered/speaker/tau=40)."""
    utterances = {"ar-sampling": _rows()} | {f"filtered/speaker/tau={k[1:]}": v for k, v in systems.items()}
    summary = {name: {"baseline": "ar-sampling", "tokens_per_forward": 1.5} for name in utterances}
    return {"systems": summary, "utterances": utterances,
            "setup": {"sweeps": {"tau": [int(k[1:]) for k in systems]}, "relaxed": {"tau": None},
                      "checkpoint": "tools/sample/model", "store": "runs/demo/store", "prompts": "prompts.jsonl"}}


def test_the_halves_are_fixed_balanced_and_apart():
    assert split_prompts(reversed(PROMPTS)) == (CHOOSING, REPORTING)
    assert len(CHOOSING) == len(REPORTING) == 20 and not CHOOSING & REPORTING


def test_exact_rows_pass_with_zero_change():
    judged = judge(_rows(speedup=1.3), _rows(), CHOOSING)
    assert judged["passes"] and judged["utterances"] == 20
    assert all(m["change"] == 0 and m["ci95"] == [0, 0] for m in judged["measures"].values())


def test_a_damaging_setting_is_refused_and_the_fastest_within_every_margin_is_chosen(tmp_path):
    report = _report(t20=_rows(1.2), t40=_rows(1.4, {"sim": 0.001}), t80=_rows(1.6, {"wer": 0.05}),
                     t160=_rows(1.9, {"log_likelihood": -0.5}))
    result = frontier(report)
    found = result["policies"]["filtered"]
    assert [p["passes"] for p in found["points"]] == [True, True, False, False]
    assert found["chosen"] == 40 and found["reported"]["passes"]
    assert not found["points"][2]["measures"]["wer"]["passes"]  # +5 points of WER: past the +2 margin
    assert "filtered (tau): chosen 40" in format_frontier(result)
    plot_frontier(result, tmp_path / "frontier.png")
    assert (tmp_path / "frontier.png").stat().st_size > 10_000


def test_a_missing_or_failed_measure_is_unmeasured_and_refused():
    missing = judge(_rows(1.5, missing=("mos",)), _rows(missing=("mos",)), CHOOSING)
    assert not missing["passes"] and missing["measures"]["mos"] == {"unmeasured": "not scored"}
    assert judge(_rows(1.5, missing=("mos",)), _rows(), CHOOSING)["measures"]["mos"] == \
        {"unmeasured": "failed on 20 of 20 utterances"}
    failed = _rows(1.5)
    failed[next(i for i, r in enumerate(failed) if r["prompt"] in CHOOSING)]["wer"] = None
    assert judge(failed, _rows(), CHOOSING)["measures"]["wer"]["unmeasured"].startswith("failed on 1 of 20")
    found = frontier(_report(t40=_rows(1.5, missing=("sim",))))["policies"]["filtered"]
    assert found["chosen"] is None and "unmeasured: sim" in found["note"]


def test_the_choice_uses_only_the_choosing_half():
    harm_reported = _rows(1.5, {"wer": 0.1}, halves=(REPORTING,))
    harm_choosing = _rows(1.8, {"wer": 0.1}, halves=(CHOOSING,))
    found = frontier(_report(t40=harm_reported, t80=harm_choosing))["policies"]["filtered"]
    assert found["chosen"] == 40 and not found["reported"]["passes"]  # the other half says what the choice hid


def test_too_little_speed_up_chooses_nothing():
    found = frontier(_report(t10=_rows(1.05)))["policies"]["filtered"]
    assert found["chosen"] is None and "passing but slower: 10" in found["note"]
    assert choose([])["chosen"] is None


def test_the_calibration_file_names_what_it_was_measured_on_and_loads(tmp_path):
    report = _report(t40=_rows(1.4), t80=_rows(1.6, {"wer": 0.05}))
    write_frontier(frontier(report), tmp_path, report["setup"])
    record = json.loads((tmp_path / SETTINGS_FILE).read_text())
    assert record["policies"] == {"filtered": {"tau": 40}} and record["model"] == "tools/sample/model"
    assert record["store"] == "runs/demo/store" and record["prompts"] == "prompts.jsonl" and record["path"] == "tree"
    assert load_relaxed_settings(tmp_path / SETTINGS_FILE)["filtered"]["tau"] == 40


def test_a_sweep_names_a_knob_and_its_values():
    assert parse_sweep("tau=10,20") == ("tau", (10, 20))
    assert parse_sweep("tau=0.3") == ("tau", (0.3,))  # a share of the probability
    assert parse_sweep("threshold=0.3, 0.5") == ("threshold", (0.3, 0.5))
    with pytest.warns(DeprecationWarning, match="similarity"):
        assert parse_sweep("similarity=0.3") == ("threshold", (0.3,))
    for bad in ("gamma=1", "tau=", "beta=high", "beta=2"):
        with pytest.raises(ValueError):
            parse_sweep(bad)
