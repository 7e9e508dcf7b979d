"""The GPU check runs end to end (here on the CPU, tiny), so the first GPU lent to the project can run it as is."""

import json

import pytest
from click.testing import CliRunner

from echospec.tools.benchmarks import cost_curves, gpu_check


@pytest.mark.slow  # about 80 s on a 2-core machine (two cost curves and a bench)
def test_gpu_check_runs_on_the_cpu(tmp_path):
    result = CliRunner().invoke(gpu_check.main, ["--device", "cpu", "--dtype", "float32", "--tiny",
                                                 "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(report["curves"]) == {"sample", "tiny"}
    for curve in report["curves"].values():
        assert curve["sizes"] == [0, 1, 2, 4, 8, 16, 32, 64] and curve["relative"][0] == 1.0
    assert {"autoregressive", "exact-greedy/speaker", "exact-sampling/speaker/n64d8", "filtered/speaker"} <= set(
        report["bench"])
    assert report["bench"]["exact-greedy/speaker"]["identical_to_baseline"] == 1.0
    assert (tmp_path / "gpu_check.png").stat().st_size > 10_000 and (tmp_path / "bench" / "bench.json").exists()


def test_cost_curves_command(tmp_path):
    result = CliRunner().invoke(cost_curves.main, ["--shapes", "tiny", "--dtypes", "float32,bfloat16", "--threads",
                                                   "1", "--repeats", "2", "--context", "40", "--variants", "repeat-kv",
                                                   "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "cost_curves.json").read_text())
    assert [(r["dtype"], r["variant"]) for r in rows] == [("float32", "plain"), ("float32", "repeat-kv"),
                                                         ("bfloat16", "plain"), ("bfloat16", "repeat-kv")]
    assert all(r["relative"][0] == 1.0 and r["one_step_ms"] > 0 for r in rows)
