"""tools/benchmarks/bench_decoder.py runs end to end on a tiny model and writes its report (speed is not asserted);
the harness's order of systems is balanced."""

import json
from collections import Counter

import pytest
from click.testing import CliRunner

from echospec.tools.bench.harness import THREAD_VARIABLES, balanced_order
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


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_balanced_order_puts_each_system_in_each_place_and_after_each_other_equally_often(n):
    systems = list("ABCDEFG"[:n])
    rounds = n if n % 2 == 0 else 2 * n  # one full Williams design
    orders = [balanced_order(systems, r) for r in range(rounds)]
    assert all(sorted(order) == systems for order in orders)
    places = Counter((place, s) for order in orders for place, s in enumerate(order))
    assert set(places.values()) == {rounds // n}
    follows = Counter(pair for order in orders for pair in zip(order, order[1:]))
    assert len(follows) == n * (n - 1) and set(follows.values()) == {rounds // n}
    assert balanced_order(systems, rounds) == orders[0]  # and then it repeats
