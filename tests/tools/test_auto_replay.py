"""tools/benchmarks/auto_replay.py: recording every cap's steps on the shipped sample, and replaying the adaptive
budget on them."""

import json
import os

import pytest
from click.testing import CliRunner

from echospec.tools.benchmarks import auto_replay
from echospec.tools.corpus import SAMPLE_CORPUS, SAMPLE_MODEL_DIR, SAMPLE_PROMPTS


@pytest.fixture(scope="module")
def sample_store(tmp_path_factory):
    from echospec.datastore import build

    path = tmp_path_factory.mktemp("store") / "sample"
    build(SAMPLE_CORPUS, path, per_speaker=True, faiss=False, progress=False)
    return path


def synthetic(rates: dict[int, float], prompts: int = 60, repeats: int = 2) -> dict:
    """A recording where every step under `cap` emits rates[cap] tokens in 1 ms."""
    runs = [{"prompt": str(p), "cap": cap, "tokens": [tokens] * 20, "seconds": [1e-3] * 20}
            for p in range(prompts) for cap, tokens in rates.items() for _ in range(repeats)]
    return {"policy": "exact-greedy", "stores": "speaker", "threads": 1, "runs": runs}


class Pinned:
    """Rates that always choose one cap."""

    def __init__(self, cap: int):
        self.caps, self.cap = (cap,), cap

    def choose(self) -> int:
        return self.cap

    def record(self, cap, tokens, seconds) -> None:
        pass


def test_record_then_replay_on_the_sample(sample_store, tmp_path):
    before = dict(os.environ)
    recording = tmp_path / "greedy.json"
    result = CliRunner().invoke(auto_replay.main, [
        "record", str(SAMPLE_MODEL_DIR), "--store", str(sample_store), "--prompts", str(SAMPLE_PROMPTS),
        "--policy", "exact-greedy", "--limit", "3", "--out", str(recording)])
    assert result.exit_code == 0, result.output
    assert dict(os.environ) == before  # threads set for this process's torch only, as `echospec bench` does
    runs = json.loads(recording.read_text())["runs"]
    assert len(runs) == 3 * len(auto_replay.RECORDED_CAPS) * 2
    for prompt in {r["prompt"] for r in runs}:
        # lossless: every cap emits the same utterance, in fewer steps on larger trees
        lengths = {sum(r["tokens"]) for r in runs if r["prompt"] == prompt}
        assert len(lengths) == 1
        plain = [r for r in runs if r["prompt"] == prompt and r["cap"] == 0]
        assert all(len(r["seconds"]) == len(r["tokens"]) == sum(r["tokens"]) for r in plain)
    result = CliRunner().invoke(auto_replay.main, ["replay", str(recording), "--replays", "5",
                                                   "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "replay.json").read_text())["exact-greedy/speaker/1t"]
    assert report["prompts"] == 3 and len(report["separate"]) == 5
    assert abs(sum(report["caps"].values()) - 1) < 1e-9 and max(report["fixed_over_best"].values()) == 1.0
    assert (tmp_path / "out" / "replay.png").stat().st_size > 5_000


def test_record_in_bfloat16_and_on_a_device_that_is_not_there(sample_store, tmp_path):
    args = ["record", str(SAMPLE_MODEL_DIR), "--store", str(sample_store), "--prompts", str(SAMPLE_PROMPTS),
            "--policy", "filtered", "--limit", "1", "--repeats", "2"]
    recording = tmp_path / "bf16.json"
    result = CliRunner().invoke(auto_replay.main, args + ["--dtype", "bfloat16", "--out", str(recording)])
    assert result.exit_code == 0, result.output
    assert json.loads(recording.read_text())["dtype"] == "bfloat16"
    result = CliRunner().invoke(auto_replay.main, ["replay", str(recording), "--replays", "2", "--out", str(tmp_path)])
    assert result.exit_code == 0 and "filtered/speaker/1t/bfloat16" in result.output, result.output
    missing = tmp_path / "missing.json"
    result = CliRunner().invoke(auto_replay.main, args + ["--device", "nope", "--out", str(missing)])
    assert result.exit_code == 1 and "cannot put the model on 'nope'" in result.output and not missing.exists()
    assert "Traceback" not in result.output


def test_record_rejects_an_unknown_policy(sample_store, tmp_path):
    out = tmp_path / "fastest.json"
    result = CliRunner().invoke(auto_replay.main, [
        "record", str(SAMPLE_MODEL_DIR), "--store", str(sample_store), "--prompts", str(SAMPLE_PROMPTS),
        "--policy", "fastest", "--out", str(out)])
    assert result.exit_code == 1 and "unknown policy 'fastest'" in result.output and not out.exists()


def test_replay_finds_the_fastest_cap():
    report = auto_replay.replay(synthetic({0: 1, 4: 2, 8: 3, 16: 2, 32: 1, 64: 1}), replays=20, cycles=2)
    assert report["fixed_over_best"]["8"] == 1.0 and report["fixed_over_best"]["4"] == pytest.approx(2 / 3)
    assert report["caps"]["8"] > 0.8  # the rest is its tries of the others and its rechecks
    assert 0.85 < report["adaptive_over_best"]["geomean"] < 1.0 and report["cycles"] == 2


def test_replay_scores_a_pinned_cap_at_that_caps_rate():
    report = auto_replay.replay(synthetic({0: 1, 4: 2, 8: 3, 16: 2, 32: 1, 64: 1}), replays=3,
                                make_rates=lambda: Pinned(4))
    assert report["adaptive_over_best_paired"]["geomean"] == pytest.approx(2 / 3)
    assert report["adaptive_over_plain"]["geomean"] == pytest.approx(2.0)
    assert report["caps"]["4"] == pytest.approx(1.0)


def test_replay_rejects_what_it_cannot_use(tmp_path):
    once = tmp_path / "once.json"
    once.write_text(json.dumps(synthetic({0: 1, 8: 2}, repeats=1)))
    some = tmp_path / "some.json"
    some.write_text(json.dumps(synthetic({0: 1, 8: 2})))  # no 4: a cap CapRates runs
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"systems": {}}))
    for path, message in ((once, "at least twice"), (some, "no utterances under caps [4]"),
                          (other, "not a recording")):
        result = CliRunner().invoke(auto_replay.main, ["replay", str(path), "--out", str(tmp_path / "out")])
        assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output
