"""The frontier's rule: the fastest setting inside the baseline's interval on every measure, or none."""

import pytest

from echospec.tools.bench.frontier import choose, format_frontier, frontier, parse_sweep, plot_frontier


def _system(speedup, wer=0.30, sim=0.90, mos=3.0, log_likelihood=0.0, mel=20.0):
    return {"baseline": "ar-sampling", "speedup": speedup, "speedup_ci95": [speedup - 0.1, speedup + 0.1],
            "speedup_paired": {"median": speedup}, "tokens_per_forward": 2.0,
            "wer": {"mean": wer}, "sim": {"mean": sim}, "mos": {"mean": mos}, "mel_distortion": {"mean": mel},
            "relative_change": {"log_likelihood": {"mean": log_likelihood, "ci95": [-0.01, 0.01]},
                                "mel_distortion": {"mean": 0.0, "ci95": [-0.01, 0.01]}}}


def _report(**points):
    baseline = {"baseline": "ar-sampling", "speedup": 1.0, "speedup_ci95": [1.0, 1.0], "tokens_per_forward": 1.0,
                "wer": {"mean": 0.30, "ci95": [0.25, 0.35]}, "sim": {"mean": 0.90, "ci95": [0.88, 0.92]},
                "mos": {"mean": 3.0, "ci95": [2.9, 3.1]}, "mel_distortion": {"mean": 20.0, "ci95": [19.0, 21.0]}}
    systems = {"ar-sampling": baseline} | {f"filtered/speaker/tau={k[1:]}": v for k, v in points.items()}
    return {"systems": systems, "setup": {"sweeps": {"tau": [int(k[1:]) for k in points]}, "relaxed": {"tau": 40}}}


def test_the_fastest_setting_inside_on_every_measure_is_chosen(tmp_path):
    report = _report(t10=_system(1.15), t20=_system(1.3, wer=0.34), t80=_system(1.6, log_likelihood=0.07),
                     t160=_system(1.9, sim=0.85))
    result = frontier(report)
    found = result["policies"]["filtered"]
    assert found["chosen"] == "20" and [p["inside"] for p in found["points"]] == [True, True, False, False]
    assert "filtered (tau): chosen 20" in format_frontier(result)
    plot_frontier(result, tmp_path / "frontier.png")
    assert (tmp_path / "frontier.png").stat().st_size > 10_000


def test_no_setting_inside_and_fast_enough_says_so():
    found = frontier(_report(t10=_system(1.05), t80=_system(1.5, mos=3.3)))["policies"]["filtered"]
    assert found["chosen"] is None and "inside but slower: 10" in found["note"]
    assert choose([], ["wer"])["chosen"] is None


def test_a_sweep_names_a_knob_and_its_values():
    assert parse_sweep("tau=10,20") == ("tau", (10, 20))
    assert parse_sweep("threshold=0.3, 0.5") == ("threshold", (0.3, 0.5))
    for bad in ("gamma=1", "tau=", "beta=high"):
        with pytest.raises(ValueError):
            parse_sweep(bad)
