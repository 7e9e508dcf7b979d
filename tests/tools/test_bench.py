"""`echospec bench` and `echospec demo` end to end on the shipped sample, with a small budget."""

import json
import os
import re

import numpy as np
import pytest
from click.testing import CliRunner

from echospec.tools.cli import main
from echospec.tools.corpus import SAMPLE_CORPUS, SAMPLE_MODEL_DIR, SAMPLE_PROMPTS, SAMPLE_TOKENIZER

SYSTEM_FIELDS = {"baseline", "tokens_per_forward", "time_per_token_ms", "speedup", "speedup_ci95", "speedup_paired",
                 "forward_cost_speedup", "lm_rtf", "new_tokens", "log_likelihood", "mel_distortion", "accepted_lengths"}


@pytest.fixture(scope="module")
def sample_store(tmp_path_factory):
    from echospec.datastore import build

    path = tmp_path_factory.mktemp("store") / "sample"
    build(SAMPLE_CORPUS, path, per_speaker=True, faiss=False, progress=False)
    return path


@pytest.mark.slow
def test_bench_lossless_policies_reproduce_autoregressive(sample_store, tmp_path):
    out = tmp_path / "bench"
    result = CliRunner().invoke(main, [
        "bench", str(SAMPLE_MODEL_DIR), "--store", str(sample_store), "--prompts", str(SAMPLE_PROMPTS),
        "--tokenizer", str(SAMPLE_TOKENIZER), "--policy", "exact-greedy", "--policy", "exact-sampling",
        "--policy", "filtered", "--limit", "2", "--max-new-tokens", "40", "--threads", "1", "--max-nodes", "auto",
        "--sweep-nodes", "4", "--sweep-policy", "exact-sampling", "--sweep-policy", "filtered", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    systems = report["systems"]
    expected = {"autoregressive", "hf-prompt-lookup", "ar-sampling", "exact-greedy/speaker", "exact-greedy/general",
                "exact-sampling/speaker", "exact-sampling/general", "filtered/speaker", "filtered/general",
                "exact-sampling/speaker/n4d8", "filtered/speaker/n4d8"}
    assert set(systems) == expected
    for name, entry in systems.items():
        assert SYSTEM_FIELDS <= set(entry), name
        assert entry["new_tokens"] > 0 and entry["tokens_per_forward"] >= 1.0
        assert set(entry["log_likelihood"]) == {"mean", "ci95"}
        low, high = entry["speedup_ci95"]
        assert low <= entry["speedup"] <= high, name
    assert systems["autoregressive"]["speedup_ci95"] == [1.0, 1.0]
    assert systems["autoregressive"]["speedup_paired"] == {"median": 1.0, "ci95": [1.0, 1.0]}
    assert all(e["speedup_paired"]["ci95"][0] <= e["speedup_paired"]["median"] <= e["speedup_paired"]["ci95"][1]
               for e in systems.values())
    for name in ("hf-prompt-lookup", "exact-greedy/speaker", "exact-greedy/general"):
        assert systems[name]["identical_to_baseline"] == 1.0, name
    for name in ("exact-sampling/speaker", "exact-sampling/general", "exact-sampling/speaker/n4d8"):
        assert systems[name]["identical_to_baseline"] == 1.0, name
    assert systems["ar-sampling"]["mel_distortion"] is not None
    # the verify-cost curve spans every tree size run, and what it predicts is 1 for autoregressive systems
    curve = report["verify_cost_curve"]
    assert curve["sizes"][0] == 0 and curve["sizes"][-1] == 8 and curve["relative"][0] == 1.0  # auto: caps 0, 4, 8
    assert curve["relative"] == sorted(curve["relative"]) and curve["context_tokens"] > 0
    assert systems["autoregressive"]["forward_cost_speedup"] == systems["ar-sampling"]["forward_cost_speedup"] == 1.0
    # two utterances are too few for "auto" to settle, and the table says so; a pinned budget needs no such note
    from echospec.tools.bench import format_table

    printed = " ".join(result.output.split())  # the short table's notes wrap at 100 columns
    assert "over 2 its figures are mostly that measuring" in printed
    assert "mostly that measuring" not in format_table(report | {"setup": report["setup"] | {"max_nodes": 8}})
    assert systems["hf-prompt-lookup"]["forward_cost_speedup"] is None  # its candidate lengths are not visible
    sampling = systems["exact-sampling/speaker"]
    assert 0 < sampling["forward_cost_speedup"] <= sampling["tokens_per_forward"]  # tree forwards never cost less
    # printed: the headline first, then a table that fits 100 columns; bench.md: the full table and its notes
    table = result.output[result.output.index("Lossless greedy: "):result.output.index("\nWrote ")]
    assert max(len(line) for line in table.splitlines()) <= 100
    assert "identical output in 2/2 utterances" in table.splitlines()[0]
    full = (out / "bench.md").read_text()
    assert "Lossless greedy: " in full and "verify-cost curve" in full and "max dlogit" in full
    assert (out / "bench.png").stat().st_size > 10_000
    assert "exact-greedy/speaker" in result.output
    # identical lossless outputs report no divergence; what the auto budget measured per cap is in the report
    assert systems["exact-greedy/speaker"]["divergences"] == []
    auto = report["auto_budgets"]["exact-greedy/speaker"]
    assert sum(auto["utterances"].values()) > 0 and auto["fastest"] in (0, 4, 8)
    # and the cap each of its steps ran, per utterance (fixed budgets keep none)
    runs = report["utterances"]["exact-greedy/speaker"]
    assert all(len(r["caps"]) == r["forwards"] - 1 and set(r["caps"]) <= {0, 4, 8} for r in runs)
    assert "caps" not in report["utterances"]["exact-sampling/speaker/n4d8"][0]
    # "auto" against the budgets swept beside it, paired by utterance: the same median as computed here
    against = report["auto_against_fixed"]
    assert set(against) == {"exact-sampling/speaker", "filtered/speaker"} and set(against["filtered/speaker"]) == {"n4d8"}
    ratios = [f["time_per_token"] / a["time_per_token"] for f, a in
              zip(report["utterances"]["filtered/speaker/n4d8"], report["utterances"]["filtered/speaker"])]
    entry = against["filtered/speaker"]["n4d8"]
    assert entry["median"] == pytest.approx(float(np.median(ratios))) and entry["ci95"][0] <= entry["median"] <= entry["ci95"][1]
    assert "auto against the fixed budgets" in printed and "filtered/speaker: n4d8" in printed
    assert report["machine"]["dtype"] == "float32"


def test_bench_rounds_decode_every_prompt_again(sample_store):
    from echospec.decoder import NODES
    from echospec.tools.bench import BenchSpec, Inputs, bench

    report = bench(BenchSpec(Inputs(SAMPLE_MODEL_DIR, sample_store, SAMPLE_PROMPTS, limit=2), policies=("exact-sampling",),
                             stores=("general",), rounds=2, max_new_tokens=8, progress=False))
    assert report["setup"]["utterances"] == 4 and report["setup"]["rounds"] == 2
    assert report["setup"]["max_nodes"] == NODES and not report["auto_budgets"]  # generate's default budget
    for name, runs in report["utterances"].items():
        assert [(r["round"], r["prompt"]) for r in runs[:2]] == [(0, runs[0]["prompt"]), (0, runs[1]["prompt"])]
        assert [(r["round"], r["prompt"]) for r in runs[2:]] == [(1, runs[0]["prompt"]), (1, runs[1]["prompt"])], name
    assert report["systems"]["exact-sampling/general"]["identical_to_baseline"] == 1.0  # paired per utterance


def test_bench_bad_prompts_file_is_a_clear_error(sample_store, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "hello", "speaker": "nobody"}\n')
    result = CliRunner().invoke(main, ["bench", str(SAMPLE_MODEL_DIR), "--store", str(sample_store),
                                       "--prompts", str(prompts), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1
    assert "prompts.jsonl:1" in result.output and "nobody" in result.output
    assert "Traceback" not in result.output


def test_bench_sweeps_only_benchmarked_policies(sample_store, tmp_path):
    result = CliRunner().invoke(main, ["bench", str(SAMPLE_MODEL_DIR), "--store", str(sample_store), "--prompts",
                                       str(SAMPLE_PROMPTS), "--policy", "exact-greedy", "--sweep-policy", "filtered",
                                       "--sweep-nodes", "4", "--out", str(tmp_path / "o")])
    assert result.exit_code == 1 and "sweep policies filtered are not among" in result.output
    assert "Traceback" not in result.output


def test_bench_refuses_a_folder_that_is_no_checkpoint(sample_store, tmp_path):
    result = CliRunner().invoke(main, ["bench", str(tmp_path), "--store", str(sample_store),
                                       "--prompts", str(SAMPLE_PROMPTS)])
    assert result.exit_code == 1 and "not a Hugging Face causal LM checkpoint" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("nodes, spelling", [("-3", "--max-nodes"), ("eight", "--max-nodes"), ("4.5", "--nodes")])
def test_bench_refuses_a_node_budget_that_is_no_budget(sample_store, nodes, spelling):
    result = CliRunner().invoke(main, ["bench", str(SAMPLE_MODEL_DIR), "--store", str(sample_store),
                                       "--prompts", str(SAMPLE_PROMPTS), spelling, nodes])
    assert result.exit_code == 2 and f"'{nodes}': a non-negative integer" in result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_demo_builds_queries_and_benchmarks(tmp_path):
    out = tmp_path / "demo"
    result = CliRunner().invoke(main, ["demo", "--out", str(out), "--limit", "1"])
    assert result.exit_code == 0, result.output
    assert "speaker stores" in result.output and "candidate nodes" in result.output
    assert "mostly that measuring" not in result.output  # the default budget is fixed: nothing to measure first
    report = json.loads((out / "bench.json").read_text())
    assert {"filtered/speaker", "tolerance/general", "similarity/speaker"} <= set(report["systems"])
    assert (out / "store" / "catalog.sqlite").exists() and (out / "bench.png").exists()
    assert (out / "frontier.png").exists() and report["frontier"]  # the default and one more setting of each knob
    # the audio: one WAV per system and the reference, side by side on listen.html with their scores
    assert "The paper's table" in result.output and report["floor"]["mos"] is not None
    assert {p.parent.name for p in (out / "audio").rglob("*.wav")} >= {"reference", "ar-sampling", "speaker"}
    page = (out / "listen.html").read_text()
    players = re.findall(r'<audio controls preload=none src="([^"]+)"', page)
    listed = [name for name in report["systems"] if "=" not in name]  # the sweeps' settings are in frontier.png
    assert len(players) == len(listed) + 1 and all((out / src).exists() for src in players)
    assert page.count("<div class=scores>WER ") == len(listed) + 1  # and the reference's


def test_bench_and_demo_turn_bad_paths_into_messages(tmp_path):
    not_a_store = tmp_path / "empty"
    not_a_store.mkdir()
    result = CliRunner().invoke(main, ["bench", str(SAMPLE_MODEL_DIR), "--store", str(not_a_store),
                                       "--prompts", str(SAMPLE_PROMPTS)])
    assert result.exit_code == 1 and "not a datastore" in result.output
    blocked = tmp_path / "file"
    blocked.write_text("")
    result = CliRunner().invoke(main, ["demo", "--out", str(blocked / "demo")])
    assert result.exit_code == 1 and "Error:" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_bench_plot_takes_auto_utterances_without_steps(tmp_path):
    # rows without caps (a bench.json from before they were recorded) are left out, not a KeyError
    from echospec.tools.bench.report import plot

    entry = {"baseline": "autoregressive", "speedup": 1.0, "speedup_ci95": [0.9, 1.1],
             "log_likelihood": {"mean": -1.0, "ci95": [-1.1, -0.9]}}
    report = {"systems": {"exact-greedy/speaker": entry},
              "utterances": {"exact-greedy/speaker": [{"caps": [8] * 16 + [0] * 8}, {}, {"caps": [4] * 24}]}}
    plot(report, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_grouped_heads_benchmark_runs_both_ways_with_the_same_tokens(sample_store, tmp_path, monkeypatch):
    from echospec.tools.benchmarks import grouped_heads

    monkeypatch.delenv(grouped_heads.SWITCH, raising=False)
    result = CliRunner().invoke(grouped_heads.main, ["--store", str(sample_store), "--limit", "3", "--max-nodes", "4",
                                                     "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "grouped_heads.json").read_text())
    assert report["same_tokens"] == 1.0 and report["utterances"] == 3  # lossless sampling, one seed per prompt
    assert set(report["systems"]) == {"autoregressive", "4 nodes, grouped heads", "4 nodes, repeat_kv"}
    assert report["systems"]["4 nodes, repeat_kv"]["tokens_per_forward"] > 1.0
    assert grouped_heads.SWITCH not in os.environ
    monkeypatch.setenv(grouped_heads.SWITCH, "1")
    result = CliRunner().invoke(grouped_heads.main, ["--store", str(sample_store), "--out", str(tmp_path)])
    assert result.exit_code == 2 and "unset TRANSFORMERS_SDPA_FORCE_GQA" in result.output


def test_the_table_opens_with_the_headline_and_fits_100_columns():
    from echospec.tools.bench import format_table

    def system(baseline, speedup, same=None):
        entry = {"baseline": baseline, "speedup": speedup, "speedup_ci95": [speedup - 0.1, speedup + 0.1],
                 "tokens_per_forward": 1.5, "relative_change": {"log_likelihood": {"mean": 0.01, "ci95": [0, 0.02]}}}
        return entry | ({} if same is None else {"identical_to_baseline": same})

    systems = {"autoregressive": system("autoregressive", 1.0), "ar-sampling": system("ar-sampling", 1.0),
               "exact-greedy/speaker": system("autoregressive", 1.62, 1.0),
               "exact-greedy/general": system("autoregressive", 1.31, 1.0),
               "exact-sampling/speaker": system("ar-sampling", 1.2, 0.75),
               "filtered/a-very-long-store-name-indeed": system("ar-sampling", 1.4)}
    report = {"systems": systems, "utterances": {name: [{}] * 4 for name in systems}}
    lines = format_table(report).splitlines()
    assert lines[0] == "Lossless greedy: 1.62x faster than autoregressive, identical output in 4/4 utterances"
    assert lines[1].startswith("(exact-greedy/speaker; ")
    assert max(map(len, lines)) <= 100
    # each group says its baseline, so no speed-up is read against the wrong one
    assert lines[3].startswith("Greedy, against autoregressive") and any(l.startswith("Sampling, against ar-sampling")
                                                                         for l in lines)
    del systems["exact-greedy/speaker"], systems["exact-greedy/general"]
    systems["exact-sampling/speaker"]["speedup"] = 0.9
    assert format_table(report).splitlines()[:2] == [
        "Lossless sampling: 0.90x the speed of ar-sampling (slower), identical output in 3/4 utterances",
        "(exact-sampling/speaker; every figure below is against the baseline its group names)"]
