"""Sharded datastores: built by parallel tasks (local processes or Ray), queried exactly as one store.

The Ray tests share one local cluster (`ray.init(num_cpus=2)`), started once: its start-up is the expensive
part. They need the `ray` extra (ray[data] with pandas, pyarrow), which the `test` extra installs: they import it
rather than skip, so a CI install that lacks it fails instead of passing without them.
"""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from echospec.datastore import CorpusError, DamagedStoreError, DatastoreError, build, enroll, open_datastore
from echospec.datastore.exact import MAX_TOKENS
from echospec.datastore.pipeline import _check_shard_sizes
from echospec.datastore.runners import LocalRunner
from echospec.datastore.tasks import stable_hash
from echospec.retriever import Retriever
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def write_jsonl(path, utterances, speakers=3):
    with open(path, "w") as f:
        for i, tokens in enumerate(utterances):
            f.write(json.dumps({"id": f"u{i}", "speaker": f"s{i % speakers}", "tokens": list(map(int, tokens)),
                                "text": f"line {i}"}) + "\n")
    return path


def random_corpus(path, n_utts=120, vocab=40, length=50, seed=0):
    rng = np.random.default_rng(seed)
    return write_jsonl(path, [rng.integers(0, vocab, rng.integers(1, length)) for _ in range(n_utts)])


def shard_checksums(store):
    return [row["sha256"] for row in open_datastore(store).info()["shards"]]


def speakers(ds):
    return {name: (row["utterances"], row["tokens"]) for name, row in ds.info()["speakers"].items()}


def trees_equal(a, b):
    return a.to_dict() == b.to_dict()


@pytest.fixture(scope="module")  # this module is its only user: Ray starts once and stops when it is done
def ray_cluster():
    import ray
    import ray.data  # noqa: F401 (the build reads the corpus with Ray Data)

    ray.init(num_cpus=2, object_store_memory=128 << 20, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    yield ray
    ray.shutdown()


# --- the layout, the catalog and the retriever on shards ------------------------------------------------


def test_sharded_store_is_one_store_split_by_utterance(tmp_path):
    corpus = random_corpus(tmp_path / "c.jsonl")
    one = build(corpus, tmp_path / "one", faiss=False, progress=False)
    four = build(corpus, tmp_path / "four", shards=4, workers=1, faiss=False, progress=False)
    info = four.info()
    assert len(four.shards) == 4 and len(one.shards) == 1
    assert [s["directory"] for s in info["shards"]] == [f"general/shard-{i:05d}" for i in range(4)]
    assert sum(s["tokens"] for s in info["shards"]) == info["tokens"] == one.info()["tokens"]
    assert sum(s["utterances"] for s in info["shards"]) == 120 and all(len(s["sha256"]) == 64 for s in info["shards"])
    assert speakers(four) == speakers(one)  # speaker stores stay whole
    # every utterance sits whole in the shard its id hashes to
    lines = [json.loads(line) for line in open(corpus)]
    for i, shard in enumerate(four.shards):
        stream = np.asarray(shard.tokens).tolist()
        mine = [u["tokens"] for u in lines if stable_hash(u["id"]) % 4 == i]
        expected = [shard.sentinel]
        for tokens in mine:
            expected += tokens + [shard.sentinel]
        assert stream == expected
    # the catalog keeps corpus order and every line's other fields
    db = sqlite3.connect(tmp_path / "four" / "catalog.sqlite")
    rows = db.execute("select id, speaker, tokens, extra from utterances").fetchall()
    assert [r[0] for r in rows] == [f"u{i}" for i in range(120)]
    assert json.loads(rows[5][3]) == {"text": "line 5"} and rows[5][1] == "s2"
    assert len(db.execute("select * from shards").fetchall()) == 4


def test_ids_past_uint16_in_one_file_widen_every_stream(tmp_path):
    """The partition files narrow each batch's tokens to uint16 while its ids fit: a corpus whose second file
    holds ids past 65,534 still gives every shard and speaker store its exact utterances, as uint32."""
    rng = np.random.default_rng(3)
    small = [rng.integers(0, 50, rng.integers(1, 20)).tolist() for _ in range(30)]
    large = [rng.integers(60_000, 70_000, rng.integers(1, 20)).tolist() for _ in range(30)]
    write_jsonl(tmp_path / "a.jsonl", small)
    with open(tmp_path / "b.jsonl", "w") as f:
        for i, tokens in enumerate(large):
            f.write(json.dumps({"id": f"v{i}", "speaker": f"s{i % 3}", "tokens": tokens}) + "\n")
    ds = build([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "store", shards=2, workers=1, faiss=False,
               progress=False)
    ids = [f"u{i}" for i in range(30)] + [f"v{i}" for i in range(30)]
    for i, shard in enumerate(ds.shards):
        assert shard.tokens.dtype == np.uint32
        expected = [shard.sentinel]
        for uid, tokens in zip(ids, small + large):
            if stable_hash(uid) % 2 == i:
                expected += tokens + [shard.sentinel]
        assert np.asarray(shard.tokens).tolist() == expected
    for name in ("s0", "s1", "s2"):
        theirs = [t for i, t in enumerate(small + large) if f"s{i % 30 % 3}" == name]
        store = ds.speaker_store(name)
        assert store.tokens.dtype == np.uint32
        expected = [store.sentinel]
        for tokens in theirs:  # corpus order
            expected += tokens + [store.sentinel]
        assert np.asarray(store.tokens).tolist() == expected


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(corpus=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=30), min_size=1, max_size=25),
       contexts=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=10), min_size=1, max_size=10),
       shards=st.integers(2, 5), min_support=st.integers(1, 8))
def test_sharded_tree_equals_one_store_tree_when_the_cap_does_not_bind(tmp_path_factory, corpus, contexts, shards,
                                                                       min_support):
    tmp = tmp_path_factory.mktemp("prop")
    path = write_jsonl(tmp / "c.jsonl", corpus)
    options = dict(faiss=False, per_speaker=True, progress=False, vocab_size=6)
    one = build(path, tmp / "one", **options)
    many = build(path, tmp / "many", shards=shards, workers=1, **options)
    for max_nodes in (4, 16, 64):
        r1 = Retriever(one, cap=10_000, min_support=min_support, max_nodes=max_nodes, use_faiss=False)
        rs = Retriever(many, cap=10_000, min_support=min_support, max_nodes=max_nodes, use_faiss=False)
        for context in contexts:
            for speaker in (None, "s0"):
                assert trees_equal(r1.propose(context, speaker=speaker), rs.propose(context, speaker=speaker))


def test_sharded_oracle_acceptance_within_one_percent_when_the_cap_binds(tmp_path):
    from echospec.tools.benchmarks.bench_shards import oracle, split_corpus
    corpus, _, held = split_corpus(300_000, 40, 2, tmp_path, seed=3)
    stores = {s: build(corpus, tmp_path / f"s{s}", shards=s, workers=1, faiss=False, per_speaker=False,
                       progress=False) for s in (1, 4)}
    scores = {s: oracle(Retriever(ds, use_faiss=False), held)["tokens_per_step"] for s, ds in stores.items()}
    assert abs(scores[4] / scores[1] - 1) <= 0.01, scores


def test_faiss_neighbours_come_from_every_shard(tmp_path):
    rng = np.random.default_rng(5)
    utterances = [rng.integers(0, 50, 40) for _ in range(200)]
    corpus = write_jsonl(tmp_path / "c.jsonl", utterances)
    ds = build(corpus, tmp_path / "s", shards=3, workers=1, vocab_size=60, progress=False,
               faiss_options={"flat_max": 100})  # IVF over the shards' vectors
    assert ds.info()["stores"][-1]["kind"] == "faiss"
    tree = Retriever(ds, prompt_lookup=False).propose([55, 56])  # ids 50..59 never occur: only FAISS answers
    assert len(tree) > 0 and set(tree.sources.tolist()) == {3}
    text = " ".join(" ".join(map(str, u)) for u in utterances)
    for node in range(len(tree)):  # every path is a continuation somewhere in the corpus
        path, at = [], node
        while at >= 0:
            path.insert(0, int(tree.tokens[at]))
            at = int(tree.parents[at])
        assert " ".join(map(str, path)) in text


def test_enroll_and_retriever_on_a_sharded_store(tmp_path):
    corpus = random_corpus(tmp_path / "c.jsonl")
    build(corpus, tmp_path / "s", shards=3, workers=1, faiss=False, progress=False)
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "s" / "general").rglob("*.npy")}
    (tmp_path / "new.jsonl").write_text(json.dumps({"id": "n1", "tokens": [1, 2, 3, 4, 1, 2, 3, 5]}) + "\n")
    ds = enroll(tmp_path / "s", "newcomer", tmp_path / "new.jsonl").datastore
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "s" / "general").rglob("*.npy")} == before
    tree = Retriever(ds, prompt_lookup=False, use_faiss=False).propose([9, 1, 2, 3], speaker="newcomer")
    assert {int(tree.tokens[i]) for i in range(len(tree)) if tree.depths[i] == 1} >= {4, 5}
    assert len(open_datastore(tmp_path / "s", verify=True).shards) == 3


def test_cli_build_info_and_verify_show_shards(tmp_path):
    from click.testing import CliRunner
    from echospec.tools.cli import main

    def run(*args):
        return CliRunner().invoke(main, [str(a) for a in args])

    corpus = random_corpus(tmp_path / "c.jsonl")
    done = run("build", corpus, tmp_path / "s", "--shards", 4, "--workers", 1, "--no-faiss", "--quiet")
    assert done.exit_code == 0 and "in 4 shards" in done.output, done.output
    done = run("info", tmp_path / "s", "--verify")
    assert done.exit_code == 0 and "general store in 4 shards" in done.output
    assert "general/shard-00003" in done.output and "every shard's too: 4" in done.output
    tokens = tmp_path / "s" / "general" / "shard-00002" / "tokens.npy"
    data = bytearray(tokens.read_bytes())
    data[-1] ^= 0xFF
    tokens.write_bytes(bytes(data))
    done = run("info", tmp_path / "s", "--verify")
    assert done.exit_code == 1 and "shard-00002/tokens.npy: checksum mismatch" in done.output
    assert "Traceback" not in done.output
    done = run("build", corpus, tmp_path / "t", "--shards", 0)
    assert done.exit_code == 2 and "--shards" in done.output


def test_bad_shard_options(tmp_path):
    corpus = random_corpus(tmp_path / "c.jsonl")
    for kwargs, message in [({"shards": 0}, "shards must be between"), ({"workers": 0}, "workers must be"),
                            ({"workers": 2, "ray": "auto"}, "drop one")]:
        with pytest.raises(DatastoreError, match=message):
            build(corpus, tmp_path / "s", progress=False, **kwargs)
    assert [p.name for p in tmp_path.iterdir()] == ["c.jsonl"]


def test_each_shard_stays_under_the_int32_suffix_array_limit():
    _check_shard_sizes([MAX_TOKENS, MAX_TOKENS - 5, 10], 3)  # the datastore as a whole may exceed 2^31
    with pytest.raises(DatastoreError, match=r"shard 1 would hold \d+ .* use --shards 4 or more"):
        _check_shard_sizes([2**30, MAX_TOKENS + 1, 10], 3)


def test_bad_corpus_in_a_sharded_build_leaves_nothing(tmp_path):
    corpus = random_corpus(tmp_path / "c.jsonl")
    with open(corpus, "a") as f:
        f.write('{"id": "bad", "speaker": "s", "tokens": [1, -3]}\n')
    with pytest.raises(CorpusError, match="c.jsonl:121: negative token id -3"):
        build(corpus, tmp_path / "s", shards=3, workers=2, faiss=False, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["c.jsonl"]  # no store, no work kept for a corpus that must change


def test_a_sharded_build_keeps_the_corpus_rules(tmp_path, caplog):
    """A repeated id is refused naming both lines whichever files and shards they are in (every copy of an id
    lands in one shard); utterances without speech are skipped with one warning; a bad speaker name is refused;
    a corpus with no speech at all is one error, with no warning first."""
    first = random_corpus(tmp_path / "a.jsonl", n_utts=30)
    (tmp_path / "b.jsonl").write_text(json.dumps({"id": "x", "speaker": "s0", "tokens": [1, 2]}) + "\n"
                                      + json.dumps({"id": "u7", "speaker": "s1", "tokens": [3, 4]}) + "\n")
    with pytest.raises(CorpusError, match=r"b.jsonl:2: utterance id 'u7' is already used at .*a.jsonl:8"):
        build([first, tmp_path / "b.jsonl"], tmp_path / "s", shards=4, workers=2, faiss=False, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl"]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"id": f"e{i}", "speaker": "s0", "tokens": tokens}) + "\n"
                                              for i, tokens in enumerate([[], [1, 2], [99]])))
    with caplog.at_level("WARNING", logger="echospec.datastore.corpus"):
        ds = build([first, tmp_path / "b.jsonl"], tmp_path / "s", shards=3, workers=1, stop_ids=[99], vocab_size=99,
                   faiss=False, progress=False)
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'b.jsonl'}:1: utterance has no speech tokens; skipped (and 1 more utterances like it)"]
    assert ds.info()["utterances"] == 31 and sum(s["utterances"] for s in ds.info()["shards"]) == 31
    (tmp_path / "c.jsonl").write_text(json.dumps({"id": "y", "speaker": "../etc", "tokens": [1]}) + "\n")
    with pytest.raises(CorpusError, match=r"c.jsonl:1: speaker name '../etc' must match .*--no-per-speaker"):
        build(tmp_path / "c.jsonl", tmp_path / "t", shards=2, workers=1, faiss=False, progress=False)
    caplog.clear()
    (tmp_path / "e.jsonl").write_text("".join(json.dumps({"id": f"e{i}", "speaker": "s0", "tokens": t}) + "\n"
                                              for i, t in enumerate([[], [99]])))
    with caplog.at_level("WARNING", logger="echospec.datastore.corpus"), \
            pytest.raises(CorpusError, match=r"e.jsonl: corpus is empty \(no speech tokens\)$"):
        build(tmp_path / "e.jsonl", tmp_path / "u", shards=2, workers=1, stop_ids=[99], faiss=False, progress=False)
    assert caplog.records == []  # the error alone: no warning about what was skipped before it


@pytest.mark.parametrize("name, value", [("sa.npy", 2**31 - 5), ("sa.npy", -1), ("first.npy", 2**40),
                                         ("tokens.npy", 7000)])
def test_a_damaged_shard_is_refused_and_named(tmp_path, name, value):
    """An out-of-range suffix-array or first-token entry, or a continuation id past the vocabulary, in one of
    four shards: propose raises DamagedStoreError naming the general store, never reads out of bounds."""
    corpus = random_corpus(tmp_path / "c.jsonl", n_utts=200, vocab=60)
    build(corpus, tmp_path / "s", shards=4, workers=1, vocab_size=60, faiss=False, progress=False)
    path = tmp_path / "s" / "general" / "shard-00002" / name
    arr = np.load(path, mmap_mode="r+")
    arr[1:-1:3] = value if arr.dtype.kind == "i" or value < np.iinfo(arr.dtype).max else 0
    arr.flush()
    del arr
    lines = [json.loads(line)["tokens"] for line in open(corpus)]
    with pytest.raises(DamagedStoreError, match=r"s/general: store is damaged .*echospec info --verify"):
        retriever = Retriever(tmp_path / "s", use_faiss=False, prompt_lookup=False, min_support=1)  # warm-up too
        for tokens in lines:
            for end in range(1, len(tokens) + 1):
                retriever.propose(tokens[:end])
    with pytest.raises(DatastoreError, match="shard-00002/.*checksum mismatch"):
        open_datastore(tmp_path / "s", verify=True)


def test_faiss_ids_outside_the_shards_are_damage():
    """FAISS ids come from the index file: a shard number past the last shard, or a position past its stream,
    is DAMAGED, never read."""
    from echospec.retriever import kernels
    from echospec.retriever.retriever import kernel_store

    class Shard:
        def __init__(self, tokens):
            self.tokens = np.asarray(tokens, np.uint16)
            self.sa = np.zeros(0, np.int32)
            self.first = np.zeros(0, np.int64)

    shards = (Shard([65535, 1, 2, 65535]), Shard([65535, 3, 4, 5, 65535]))
    store = kernel_store(shards)
    out = np.empty((4, 3), np.int64)
    rows = kernels.gather_positions(store, np.array([1, (1 << 32) | 1]), 10, 10, 0, out, 0)
    assert rows == 2 and out[:2].tolist() == [[2, -1, -1], [4, 5, -1]]
    for bad in [(2 << 32) | 1, (1 << 32) | 5, 1 << 40]:
        assert kernels.gather_positions(store, np.array([1, bad]), 10, 10, 0, out, 0) == kernels.DAMAGED
    shards[1].tokens[3] = 12  # a continuation id past the vocabulary, not the sentinel
    assert kernels.gather_positions(store, np.array([(1 << 32) | 1]), 10, 10, 0, out, 0) == kernels.DAMAGED


def test_the_catalog_checks_its_shard_rows(tmp_path):
    corpus = random_corpus(tmp_path / "c.jsonl")
    build(corpus, tmp_path / "s", shards=3, workers=1, faiss=False, progress=False)
    catalog = tmp_path / "s" / "catalog.sqlite"
    original = catalog.read_bytes()
    for statement, message, verify in [
        ("update shards set directory = '../../etc' where shard = 1", "outside the datastore", False),
        ("delete from shards where shard = 1", "shard rows are not numbered 0..2", False),
        ("update shards set tokens = -1 where shard = 0", "shard 0 has tokens -1", False),
        ("update shards set sha256 = 'x' where shard = 2", "shard 2's checksum does not match", True),
        ("delete from files where path = 'general/shard-00001/sa.npy'", "lists no general/shard-00001/sa.npy", True),
        ("update shards set tokens = tokens + 1 where shard = 0", "the shards hold", True),
    ]:
        db = sqlite3.connect(catalog)
        db.execute(statement)
        db.commit()
        db.close()
        with pytest.raises(DatastoreError, match=message):
            open_datastore(tmp_path / "s", verify=verify)
        catalog.write_bytes(original)
    open_datastore(tmp_path / "s", verify=True)


def test_without_the_ray_extra_the_message_names_it(tmp_path):
    corpus = random_corpus(tmp_path / "c.jsonl")
    code = ("import sys; sys.modules['ray'] = None\n"
            "from echospec.datastore import build, DatastoreError\n"
            f"try:\n    build({str(corpus)!r}, {str(tmp_path / 's')!r}, ray='auto', progress=False)\n"
            "except DatastoreError as e:\n    print(e)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "needs the optional 'ray' extra: pip install -e '.[ray]' in a checkout" in done.stdout, done.stderr


# --- killed and resumed builds ---------------------------------------------------------------------------


def corpus_with_a_big_utterance(tmp_path, shards):
    """A small JSONL corpus plus one 800k-token utterance (.npz) whose shard takes about a second to build."""
    small = random_corpus(tmp_path / "c.jsonl", n_utts=60, vocab=2000)
    rng = np.random.default_rng(1)
    big = rng.integers(0, 2000, 800_000)
    np.savez(tmp_path / "big.npz", tokens=big, lengths=np.array([len(big)]), ids=np.array(["big"]),
             speakers=np.array(["s0"]))
    return [small, tmp_path / "big.npz"], stable_hash("big") % shards


class ShardKiller(threading.Thread):
    """Kills the worker process as soon as it starts building shard `shard` (its task.json names it)."""

    def __init__(self, parent, shard):
        super().__init__(daemon=True)
        self.parent, self.pattern, self.shard = parent, f".*.work-*/shards/.shard-{shard:05d}.tmp-*/task.json", shard
        self.killed, self.stop = None, False

    def run(self):
        deadline = time.monotonic() + 120
        while not self.stop and time.monotonic() < deadline:
            for path in self.parent.glob(self.pattern):
                try:
                    pid = json.loads(path.read_text())["pid"]
                except (OSError, ValueError):
                    continue
                finished = list(self.parent.glob(f".*.work-*/shards/shard-{self.shard:05d}"))
                if not finished:
                    os.kill(pid, signal.SIGKILL)
                    self.killed = pid
                return
            time.sleep(0.002)


def children() -> set[int]:
    """This process's child processes, from /proc."""
    mine = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[1]) == os.getpid():
            mine.add(int(stat.parent.name))
    return mine


def test_local_workers_serve_both_phases_and_end_with_the_runner():
    """The partition tasks and the store tasks run in the same spawned workers (one start, ~0.6 s each)."""
    runner = LocalRunner(2)
    try:
        first = {pid for _, pid in runner.partition([(i, os.getpid, {}, 1) for i in range(4)])}
        after_first = children()  # the pool's workers (and multiprocessing's resource tracker)
        second = {pid for _, pid in runner.run([(i, os.getpid, {}, 1) for i in range(4)])}
        assert os.getpid() not in first | second
        assert first | second <= after_first and children() == after_first  # no process started for the second
    finally:
        runner.close()
    assert not children() & (first | second)


def test_killed_local_shard_task_fails_cleanly_and_a_rerun_reuses_finished_shards(tmp_path):
    corpus, big_shard = corpus_with_a_big_utterance(tmp_path, 4)
    options = dict(shards=4, workers=2, per_speaker=False, faiss=False, progress=False)
    killer = ShardKiller(tmp_path, big_shard)
    killer.start()
    with pytest.raises(DatastoreError, match="a build task died .* run the same build again to resume"):
        build(corpus, tmp_path / "store", **options)
    killer.stop = True
    assert killer.killed
    assert not (tmp_path / "store").exists()
    with pytest.raises(DatastoreError, match="no such datastore"):
        open_datastore(tmp_path / "store")
    (work,) = tmp_path.glob(".store.work-*")
    finished = {p.name: p for p in (work / "shards").glob("shard-*")}
    assert f"shard-{big_shard:05d}" not in finished
    builders = {name: json.loads((p / "manifest.json").read_text())["pid"] for name, p in finished.items()}
    damaged = None
    if finished:  # a finished shard whose file was damaged since is built again, not reused
        damaged = sorted(finished)[0]
        path = finished[damaged] / "tokens.npy"
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x01  # same size, other content
        path.write_bytes(bytes(data))
    ds = build(corpus, tmp_path / "store", **options)
    assert not list(tmp_path.glob(".store.work-*"))
    built_by = {f"shard-{int(t['task'].split()[1]):05d}": t["pid"] for t in ds.info()["build_tasks"]}
    for name, pid in builders.items():
        assert (built_by[name] == pid) == (name != damaged)  # reused unless damaged
    open_datastore(tmp_path / "store", verify=True)
    assert shard_checksums(tmp_path / "store") == shard_checksums(
        build(corpus, tmp_path / "fresh", **dict(options, workers=1)).root)


def test_killed_driver_leaves_no_datastore_and_rerun_resumes(tmp_path):
    corpus, big_shard = corpus_with_a_big_utterance(tmp_path, 3)
    code = ("from echospec.datastore import build\n"
            "if __name__ == '__main__':\n"
            f"    build({[str(c) for c in corpus]!r}, {str(tmp_path / 'store')!r}, shards=3, workers=1,"
            " per_speaker=False, faiss=False, progress=False)")
    script = tmp_path / "build.py"
    script.write_text(code)
    proc = subprocess.Popen([sys.executable, str(script)])
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".store.work-*/shards/.shard-*/task.json")) and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "store").exists()
    assert list(tmp_path.glob(".store.work-*/parts/unit-*/done.json"))  # the corpus was read: kept
    # A finished partition file damaged since, at its size: the re-runs all died with a traceback
    # (zipfile.BadZipFile: Bad CRC-32) until the work directory was deleted by hand.
    damaged = max(tmp_path.glob(".store.work-*/parts/unit-*/*.shard-*.npz"), key=lambda p: p.stat().st_size)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    rerun = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert rerun.returncode == 0 and "Traceback" not in rerun.stderr, rerun.stderr[-2000:]
    open_datastore(tmp_path / "store", verify=True)
    assert not list(tmp_path.glob(".store.*"))
    assert shard_checksums(tmp_path / "store") == shard_checksums(build(
        corpus, tmp_path / "fresh", shards=3, workers=1, per_speaker=False, faiss=False, progress=False).root)


# --- Ray and Parquet ---------------------------------------------------------------------------------------


def write_parquet_files(tmp_path, utterances, n_files=3):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "pq").mkdir()
    per_file = -(-len(utterances) // n_files)
    for k in range(n_files):
        rows = list(enumerate(utterances))[k * per_file:(k + 1) * per_file]
        table = pa.table({"id": [f"u{i}" for i, _ in rows], "speaker": [f"s{i % 3}" for i, _ in rows],
                          "tokens": [list(map(int, t)) for _, t in rows], "text": [f"line {i}" for i, _ in rows]})
        pq.write_table(table, tmp_path / "pq" / f"part-{k}.parquet", row_group_size=15)  # several row groups
    return str(tmp_path / "pq" / "*.parquet")


def test_parquet_files_build_the_same_store_as_jsonl(tmp_path):
    rng = np.random.default_rng(2)
    utterances = [rng.integers(0, 40, rng.integers(1, 50)) for _ in range(100)]
    jsonl = write_jsonl(tmp_path / "c.jsonl", utterances)
    parquet = write_parquet_files(tmp_path, utterances)
    a = build(jsonl, tmp_path / "a", shards=2, workers=1, faiss=False, progress=False)
    b = build(parquet, tmp_path / "b", shards=2, workers=1, faiss=False, progress=False)
    assert shard_checksums(a.root) == shard_checksums(b.root)
    assert speakers(b) == speakers(a)
    db = sqlite3.connect(tmp_path / "b" / "catalog.sqlite")
    assert db.execute("select id, source, extra from utterances where id = 'u40'").fetchone() == \
        ("u40", f"{tmp_path}/pq/part-1.parquet:row 6", json.dumps({"text": "line 40"}))


def test_ray_builds_four_shards_from_parquet_as_local_processes_do(ray_cluster, tmp_path):
    rng = np.random.default_rng(4)
    utterances = [rng.integers(0, 60, rng.integers(1, 80)) for _ in range(150)]
    parquet = write_parquet_files(tmp_path, utterances)
    on_ray = build(parquet, tmp_path / "ray", shards=4, ray="auto", faiss=False, progress=False)
    local = build(write_jsonl(tmp_path / "c.jsonl", utterances), tmp_path / "local", shards=4, workers=1,
                  faiss=False, progress=False)
    assert shard_checksums(on_ray.root) == shard_checksums(local.root)
    assert speakers(on_ray) == speakers(local)
    assert ray_cluster.is_initialized()  # the build used the running cluster and left it running
    tasks = on_ray.info()["build_tasks"]
    assert sorted(t["task"] for t in tasks) == [f"shard {i}" for i in range(4)] + [f"speakers {j}" for j in range(4)]
    context = utterances[7][:5]
    assert trees_equal(Retriever(on_ray, use_faiss=False).propose(context, speaker="s1"),
                       Retriever(local, use_faiss=False).propose(context, speaker="s1"))


def test_ray_retries_a_shard_task_whose_worker_is_killed(ray_cluster, tmp_path):
    corpus, big_shard = corpus_with_a_big_utterance(tmp_path, 4)
    killer = ShardKiller(tmp_path, big_shard)
    killer.start()
    ds = build(corpus, tmp_path / "store", shards=4, ray="auto", per_speaker=False, faiss=False, progress=False)
    killer.stop = True
    assert killer.killed  # killed mid-build: Ray ran the task again
    builder = next(t for t in ds.info()["build_tasks"] if t["task"] == f"shard {big_shard}")
    assert builder["pid"] != killer.killed
    open_datastore(tmp_path / "store", verify=True)
    assert shard_checksums(ds.root) == shard_checksums(
        build(corpus, tmp_path / "local", shards=4, workers=1, per_speaker=False, faiss=False, progress=False).root)


def test_service_serves_and_enrolls_a_sharded_store_unchanged(tmp_path):
    from echospec.retriever.client import RemoteRetriever
    from service_testing import API_KEY, VOCAB, Server, synthetic_corpus
    from service_testing import write_jsonl as write_rows

    corpus = synthetic_corpus(20_000)
    ds = build(write_rows(corpus, tmp_path / "c.jsonl"), tmp_path / "voices", shards=4, workers=1,
               vocab_size=VOCAB, faiss=False, progress=False)
    one = build(tmp_path / "c.jsonl", tmp_path / "one", vocab_size=VOCAB, faiss=False, progress=False)
    rng = np.random.default_rng(0)
    with Server(tmp_path / "voices") as server, RemoteRetriever(server.url, store="voices", timeout=5.0,
                                                                 api_key=API_KEY) as remote:
        for _ in range(30):
            utterance = corpus[int(rng.integers(len(corpus)))]
            context = np.array(utterance["tokens"][:int(rng.integers(1, len(utterance["tokens"])))])
            got = remote.propose(context, speaker=utterance["speaker"])
            assert got.to_dict() == Retriever(ds).propose(context, speaker=utterance["speaker"]).to_dict()
            assert trees_equal(Retriever(ds, cap=10**6, use_faiss=False).propose(context),
                               Retriever(one, cap=10**6, use_faiss=False).propose(context))
        remote.enroll("carol", [{"id": "c1", "tokens": corpus[0]["tokens"]}])
        context = np.array(corpus[0]["tokens"][:12])
        assert remote.propose(context, speaker="carol").to_dict() == \
            Retriever(tmp_path / "voices").propose(context, speaker="carol").to_dict()
    assert len(open_datastore(tmp_path / "voices", verify=True).shards) == 4


def test_a_work_file_damaged_during_a_build_is_one_line_and_read_again(tmp_path):
    """Damage after the driver's checks (a disk error mid-build): the shard task says so in one line and removes
    the unit, so that the next run partitions it again."""
    from echospec.datastore.tasks import build_shard

    unit = tmp_path / "parts" / "unit-000000"
    unit.mkdir(parents=True)
    (unit / "chunk-0000.shard-00000.npz").write_bytes(b"PK\x03\x04 not an archive")
    with pytest.raises(DatastoreError, match=r"chunk-0000.shard-00000.npz: a build work file is damaged \(.*\); it "
                                             r"was removed: run the same build again$"):
        build_shard(str(tmp_path), 0, [str(unit / "chunk-0000.shard-00000.npz")], 50, 8, 1)
    assert not unit.exists() and not list((tmp_path / "shards").iterdir())
