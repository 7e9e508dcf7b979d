"""tools/benchmarks/bench_decoder.py runs end to end on a tiny model and writes its report (speed is not asserted)."""

import json

from click.testing import CliRunner

from echospec.tools.bench.harness import THREAD_VARIABLES
from echospec.tools.benchmarks.bench_decoder import main


def test_bench_decoder_writes_report_and_plot(tmp_path, monkeypatch):
    for variable in THREAD_VARIABLES:  # the command pins threads for its children: undone after the test
        monkeypatch.setenv(variable, "1")
    result = CliRunner().invoke(main, ["--vocab", "64", "--hidden", "64", "--layers", "1", "--prompts", "1",
                                       "--rounds", "1", "--prompt-length", "16", "--max-new-tokens", "12",
                                       "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "bench_decoder.json").read_text())
    assert (tmp_path / "bench_decoder.png").stat().st_size > 0
    systems = report["systems"]
    for lossless in ("hf-prompt-lookup", "echospec-ar-greedy", "exact-greedy", "exact-greedy-auto",
                     "never-accepted-auto", "never-accepted-16"):
        assert systems[lossless]["identical_to_hf_greedy"], lossless
    assert report["cost_curve"]["sizes"][0] == 0 and systems["hf-greedy"]["ratio_to_hf_greedy"] == 1.0
    assert "verify-cost curve" in result.output
