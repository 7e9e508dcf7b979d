"""`echospec build | enroll | info | query` through click's CliRunner, bad input included."""

import json
import os
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from echospec.tools.cli import main


def run(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def fails_cleanly(result, message, code=1):
    assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit)  # click's clean exit, not an uncaught error
    assert message in result.output and "Traceback" not in result.output


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("cli") / "corpus.jsonl"
    with open(path, "w") as f:
        f.writelines(json.dumps({"id": f"u{i}", "speaker": ["ann", "bob"][i % 2],
                                "tokens": rng.integers(0, 30, 40).tolist() + [30]}) + "\n" for i in range(60))
    return path


@pytest.fixture(scope="module")
def store(corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp("cli-store") / "store"
    result = run("build", corpus, path, "--vocab-size", 30, "--stop-id", 30, "--quiet")
    assert result.exit_code == 0, result.output
    assert "built" in result.output and "2400 tokens" in result.output and "2 speaker stores" in result.output
    return path


def test_build_options_and_progress(corpus, tmp_path):
    result = run("build", corpus, tmp_path / "s", "--no-per-speaker", "--no-faiss", "--n-max", 4,
                 "--stop-id", 30, "--vocab-size", 30)
    assert result.exit_code == 0, result.output
    info = json.loads(run("info", tmp_path / "s", "--json").output)
    assert info["speakers"] == {} and info["faiss_bytes"] == 0 and info["n_max"] == 4


def test_build_faiss_options(corpus, tmp_path):
    result = run("build", corpus, tmp_path / "s", "--faiss-dim", 8, "--faiss-max-vectors", 500, "--quiet",
                 "--stop-id", 30, "--vocab-size", 30)
    assert result.exit_code == 0, result.output
    faiss_row = json.loads(run("info", tmp_path / "s", "--json").output)["stores"][-1]
    assert faiss_row["vectors"] == 500 and faiss_row["params"]["dim"] == 8
    fails_cleanly(run("build", corpus, tmp_path / "t", "--faiss-dim", 0), "Invalid value for '--faiss-dim'", code=2)


def test_info_text_json_and_verify(store):
    text = run("info", store)
    assert text.exit_code == 0 and "2400 tokens" in text.output and "speaker:ann" in text.output
    data = json.loads(run("info", store, "--json").output)
    assert data["tokens"] == 2400 and data["vocabulary"]["stop_ids"] == [30] and set(data["speakers"]) == {"ann", "bob"}
    general = Path(data["path"]) / "general"
    serving = data["serving"]  # what serving maps: the general store's stream and suffix array, and auto's choice
    assert serving == {"stream_bytes": (general / "tokens.npy").stat().st_size,
                       "sa_bytes": (general / "sa.npy").stat().st_size,
                       "access": "readahead" if Path("/proc/meminfo").exists() else "random"}
    stream_mb = serving["stream_bytes"] / 1e6
    assert f"({stream_mb:.2f} MB for --access stream); here auto: {serving['access']}" in text.output
    verified = run("info", store, "--verify")
    assert verified.exit_code == 0 and "all files verified" in verified.output


def test_query_one_shot_text_and_json(store):
    result = run("query", store, "--context", "1 2 3", "--speaker", "ann")
    assert result.exit_code == 0, result.output
    assert "nodes, depth" in result.output and " us" in result.output and "speaker ann" in result.output
    data = json.loads(run("query", store, "--context", "[1, 2, 3]", "--json", "--max-nodes", 4).output)
    assert len(data["tree"]["tokens"]) <= 4 and data["latency_us"] > 0 and data["context_length"] == 3


def test_query_interactive(store, tmp_path):
    script = "1 2 3\n:speaker bob\n4,5,6\nnot ids\n:speaker nobody\n:nodes 2\n7 8\n:speakers\n:open {}\n9\n:quit\n"
    result = run("query", store, input=script.format(store))
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.count("nodes, depth") == 4 and "speaker: bob" in out and "speaker bob" in out
    assert "error: 'not' is not an integer token id" in out and "error: unknown speaker 'nobody'" in out
    assert "-- 2 nodes" in out or "-- 1 nodes" in out or "-- 0 nodes" in out
    assert "ann bob" in out
    assert run("query", store, input="1 2\n").exit_code == 0  # end of input ends the session


def test_enroll_command(store, tmp_path):
    extra = tmp_path / "cat.jsonl"
    extra.write_text(json.dumps({"tokens": [1, 2, 3, 4]}) + "\n")
    result = run("enroll", store, "cat", extra)
    assert result.exit_code == 0 and "enrolled cat: 1 utterances added; now 1 utterances, 4 tokens" in result.output
    result = run("enroll", store, "cat", extra, extra, "--replace")
    assert result.exit_code == 0 and "replaced cat: 2 utterances added; now 2 utterances, 8 tokens" in result.output
    fails_cleanly(run("enroll", store, "cat", tmp_path / "missing.jsonl"), "corpus file not found")


@pytest.mark.parametrize("lines, message", [
    (None, "corpus file not found"),
    ([], "corpus is empty"),
    (['{"speaker": "a", "tokens": [1, 2]}', '{"speaker": "a", "tokens": [1, 2'], "bad.jsonl:2: not valid JSON"),
    (['{"speaker": "a", "tokens": [1, "x"]}'], "bad.jsonl:1: token 'x' is not an integer"),
    (['{"speaker": "a", "tokens": [1, -2]}'], "bad.jsonl:1: negative token id -2"),
    (['{"speaker": "a", "tokens": [1, 31]}'], "bad.jsonl:1: token id 31 is outside the speech range 0..29"),
    (['{"speaker": "a", "tokens": [1, 2]}', '{"tokens": [1, 2]}'], "bad.jsonl:2: utterance 'bad:2' has no 'speaker'"),
])
def test_build_bad_corpus(tmp_path, lines, message):
    corpus = tmp_path / "bad.jsonl"
    if lines is not None:
        corpus.write_text("".join(line + "\n" for line in lines))
    fails_cleanly(run("build", corpus, tmp_path / "out", "--vocab-size", 30, "--quiet"), message)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_build_refuses_existing_target_without_force(store, corpus):
    fails_cleanly(run("build", corpus, store, "--quiet"), "already exists (use --force")


@pytest.fixture
def damaged(store, tmp_path):
    """A byte-for-byte copy of the store that a test may damage."""
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    return copy


def test_truncated_store(damaged):
    sa = damaged / "general" / "sa.npy"
    os.truncate(sa, 100)
    for args in (["info", damaged], ["query", damaged, "--context", "1"], ["enroll", damaged, "x", sa]):
        fails_cleanly(run(*args), "truncated or changed")


def test_checksum_failure(damaged):
    tokens = damaged / "general" / "tokens.npy"
    data = bytearray(tokens.read_bytes())
    data[200] ^= 1
    tokens.write_bytes(bytes(data))
    assert run("info", damaged).exit_code == 0
    fails_cleanly(run("info", damaged, "--verify"), "checksum mismatch")


def test_unknown_format_version(damaged):
    db = sqlite3.connect(damaged / "catalog.sqlite")
    db.execute("update meta set value = '7' where key = 'format_version'")
    db.commit()
    db.close()
    fails_cleanly(run("info", damaged), "unknown datastore format version 7")


def test_query_bad_input(store, tmp_path):
    fails_cleanly(run("query", store, "--context", "1 two"), "'two' is not an integer token id", code=2)
    fails_cleanly(run("query", store, "--context", "1 300"), "context ids must be in 0..29")
    fails_cleanly(run("query", store, "--context", "1", "--speaker", "zed"), "unknown speaker 'zed'")
    fails_cleanly(run("query", tmp_path / "none", "--context", "1"), "no such datastore directory")
    fails_cleanly(run("query", store, "--context", "1", "--max-nodes", "-2"), "-2 is not in the range x>=1", code=2)
    fails_cleanly(run("query", store, "--context", "1", "--max-depth", "0"), "0 is not in the range x>=1", code=2)
