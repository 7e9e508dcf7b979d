"""Catalog: what it records, file checks (size always, sha256 on demand), format version, and
builds that are interrupted or aimed at an existing target."""

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from echospec.datastore import FORMAT_VERSION, CorpusError, DatastoreError, build, open_datastore


def make_corpus(path, n_utts=40, seed=0, vocab=64):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        f.writelines(json.dumps({"id": f"u{i}", "speaker": f"s{i % 3}", "tokens": rng.integers(0, vocab, 30).tolist(),
                                "text": f"sentence {i}"}) + "\n" for i in range(n_utts))
    return path


@pytest.fixture
def store(tmp_path):
    build(make_corpus(tmp_path / "c.jsonl"), tmp_path / "store", faiss=False, progress=False)
    return tmp_path / "store"


def test_catalog_records_everything(store):
    info = open_datastore(store).info()
    assert info["format_version"] == FORMAT_VERSION
    assert info["utterances"] == 40 and info["tokens"] == 1200
    assert info["vocabulary"] == {"speech_offset": 0, "size": 64, "stop_ids": [], "drop_ids": [], "codebooks": 1,
                                  "dtype": "uint16"}
    assert (info["n_min"], info["n_max"]) == (1, 8)
    assert set(info["speakers"]) == {"s0", "s1", "s2"} and info["speakers"]["s0"]["utterances"] == 14
    assert [s["name"] for s in info["stores"]] == ["general", "speaker:s0", "speaker:s1", "speaker:s2"]
    assert info["build"]["per_speaker"] is True and info["build_seconds"] >= 0
    assert info["exact_bytes"] == sum(f.stat().st_size for f in store.rglob("*.npy"))
    assert {f["path"] for f in info["files"]} == {p.relative_to(store).as_posix() for p in store.rglob("*.npy")}
    db = sqlite3.connect(store / "catalog.sqlite")
    files = db.execute("select path, bytes, sha256 from files").fetchall()
    assert len(files) == 16 and all(len(sha) == 64 for _, _, sha in files)  # 4 stores x tokens, sa, first, index
    assert db.execute("select count(*) from utterances").fetchone() == (40,)


def test_truncated_file_is_refused(store):
    sa = store / "general" / "sa.npy"
    os.truncate(sa, sa.stat().st_size - 4)
    with pytest.raises(DatastoreError, match=r"sa.npy: \d+ bytes, the catalog says \d+ \(truncated"):
        open_datastore(store)


def test_checksum_failure_is_found_on_verify(store):
    tokens = store / "general" / "tokens.npy"
    data = bytearray(tokens.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    tokens.write_bytes(bytes(data))
    open_datastore(store)  # sizes match: opening stays cheap
    with pytest.raises(DatastoreError, match="tokens.npy: checksum mismatch"):
        open_datastore(store, verify=True)
    with pytest.raises(DatastoreError, match="checksum mismatch"):
        open_datastore(store).verify()


def test_unknown_format_version_is_refused(store):
    db = sqlite3.connect(store / "catalog.sqlite")
    db.execute("update meta set value = '99' where key = 'format_version'")
    db.commit()
    db.close()
    with pytest.raises(DatastoreError, match="unknown datastore format version 99"):
        open_datastore(store)


def test_not_a_datastore(tmp_path):
    with pytest.raises(DatastoreError, match="no such datastore"):
        open_datastore(tmp_path / "absent")
    with pytest.raises(DatastoreError, match="not a datastore"):
        open_datastore(tmp_path)
    (tmp_path / "catalog.sqlite").write_text("garbage" * 100)
    with pytest.raises(DatastoreError, match="unreadable catalog"):
        open_datastore(tmp_path)


def test_existing_target_needs_force(tmp_path, store):
    corpus = make_corpus(tmp_path / "d.jsonl", seed=1)
    with pytest.raises(DatastoreError, match="already exists"):
        build(corpus, store, faiss=False, progress=False)
    assert open_datastore(store).info()["tokens"] == 1200  # untouched
    build(corpus, store, faiss=False, progress=False, force=True, per_speaker=False)
    assert open_datastore(store).speakers == ()
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "thesis.txt").write_text("do not delete")
    with pytest.raises(DatastoreError, match="not a datastore; refusing"):
        build(corpus, tmp_path / "precious", faiss=False, progress=False, force=True)
    assert (tmp_path / "precious" / "thesis.txt").exists()


def test_bad_build_options(tmp_path):
    corpus = make_corpus(tmp_path / "c.jsonl")
    for kwargs, message in [({"n_min": 0}, "n_min"), ({"n_min": 5, "n_max": 4}, "n_min"),
                            ({"vocab_size": 0}, "vocab_size"), ({"speech_offset": -1}, "speech_offset"),
                            ({"embeddings": tmp_path / "none.npy"}, "embedding file not found")]:
        with pytest.raises(DatastoreError, match=message):
            build(corpus, tmp_path / "s", progress=False, **kwargs)
    assert not (tmp_path / "s").exists()


def test_killed_build_leaves_nothing_that_looks_valid(tmp_path):
    corpus = make_corpus(tmp_path / "c.jsonl", n_utts=3000, vocab=4000)
    code = (f"from echospec.datastore import build; "
            f"build({str(corpus)!r}, {str(tmp_path / 'store')!r}, progress=False)")
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".store.building-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "store").exists()
    (leftover,) = tmp_path.glob(".store.building-*")
    with pytest.raises(DatastoreError, match="not a datastore"):
        open_datastore(leftover)
    build(corpus, tmp_path / "store", faiss=False, progress=False)  # the next build clears the leftover
    assert not list(tmp_path.glob(".store.building-*"))


def catalog_rows(store):
    db = sqlite3.connect(store / "catalog.sqlite")
    rows = [db.execute(query).fetchall() for query in ("SELECT * FROM utterances ORDER BY rowid",
                                                       "SELECT name, utterances, tokens FROM speakers ORDER BY name",
                                                       "SELECT name, utterances, tokens FROM stores ORDER BY name")]
    db.close()
    return rows


def test_rows_written_beside_the_stores_equal_the_drivers(tmp_path, monkeypatch, capsys):
    """A build of ROWS_APART utterances or more writes its catalog in a process of its own while the stores
    build (rows.py): the very catalog rows the driver writes after them for a smaller build, and a build with
    progress shows how many are written while it waits for them."""
    corpus = make_corpus(tmp_path / "c.jsonl", n_utts=300)
    build(corpus, tmp_path / "driver", faiss=False, progress=False)
    monkeypatch.setattr("echospec.datastore.rows.ROWS_APART", 0)
    capsys.readouterr()
    build(corpus, tmp_path / "apart", faiss=False, progress=True)
    err = capsys.readouterr().err
    assert "writing catalog rows" in err and "300/300" in err
    assert catalog_rows(tmp_path / "apart") == catalog_rows(tmp_path / "driver")
    assert len(catalog_rows(tmp_path / "apart")[0]) == 300
    phases = [open_datastore(tmp_path / name).info()["build_phases"] for name in ("driver", "apart")]
    assert [p.get("catalog_rows_apart") for p in phases] == [None, 1] and phases[1]["catalog_rows"] > 0
    assert open_datastore(tmp_path / "apart", verify=True).speakers == ("s0", "s1", "s2")


def test_a_failed_build_ends_its_rows_process(tmp_path, monkeypatch):
    """A store task fails (a repeated id is found where its copies meet): the rows' process is killed, and the
    build leaves no datastore and no temporary directory."""
    monkeypatch.setattr("echospec.datastore.rows.ROWS_APART", 0)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": uid, "speaker": "s", "tokens": [1, 2, 3]}) + "\n"
                              for uid in ("a", "b", "a")))
    with pytest.raises(CorpusError, match="utterance id 'a' is already used"):
        build(corpus, tmp_path / "store", faiss=False, progress=False)
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields, cmdline = stat.read_text().rsplit(")", 1)[1].split(), (stat.parent / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == os.getpid() and b"echospec.datastore.rows" in cmdline:
            children.append(stat.parent.name)
    assert children == []
    assert not (tmp_path / "store").exists() and not list(tmp_path.glob(".store.*"))


def damage(store, *statements):
    db = sqlite3.connect(store / "catalog.sqlite")
    for statement in statements:
        db.execute(statement)
    db.commit()
    db.close()


def one_line_error(*args):
    """`echospec ARGS` through click's runner: exit 1 with one `Error:` line, no traceback."""
    from click.testing import CliRunner
    from echospec.tools.cli import main
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


@pytest.mark.parametrize("statement, message", [
    ("DELETE FROM meta WHERE key = 'sort_depth'", "meta has no 'sort_depth'"),
    ("DELETE FROM stores WHERE name = 'general'", "no 'general' exact store"),
    ("UPDATE meta SET value = '{nope' WHERE key = 'n_min'", "meta 'n_min' is not JSON"),
    ("UPDATE meta SET value = '\"abc\"' WHERE key = 'vocab_size'", "meta 'vocab_size' is 'abc', not an integer"),
    ("UPDATE meta SET value = '9' WHERE key = 'n_min'", "n_min, n_max or stop_ids are inconsistent"),
    ("UPDATE stores SET params = '[' WHERE name = 'general'", "store 'general' has params that are not a JSON"),
    ("UPDATE stores SET directory = '../../../etc' WHERE name = 'speaker:s0'", "'../../../etc', outside the"),
    ("UPDATE stores SET directory = '/etc' WHERE name = 'speaker:s1'", "'/etc', outside the datastore"),
    ("UPDATE stores SET kind = 'magic' WHERE name = 'general'", "unknown kind 'magic'"),
    ("UPDATE speakers SET store = 'nowhere' WHERE name = 's2'", "speaker 's2' has no exact store"),
    ("UPDATE files SET path = '../c.jsonl' WHERE path = 'general/sa.npy'", "file row '../c.jsonl'"),
    ("DROP TABLE files", "no 'files' table"),
    ("DROP TABLE stores", "no 'stores' table"),
    ("ALTER TABLE stores DROP COLUMN kind", "no column 'kind'"),
])
def test_damaged_catalog_is_refused_in_one_line(store, statement, message):
    """Every reader gets one DatastoreError line: open_datastore, info (with and without --verify),
    query, and the Retriever."""
    from echospec.retriever import Retriever
    damage(store, statement)
    for call in (lambda: open_datastore(store), lambda: open_datastore(store, verify=True),
                 lambda: Retriever(store)):
        with pytest.raises(DatastoreError, match=re.escape(message)):
            call()
    for args in (("info", store), ("info", "--verify", store), ("query", store, "--context", "1 2")):
        assert message in one_line_error(*args)


@pytest.mark.parametrize("statement, message", [
    ("DELETE FROM files WHERE path = 'general/first.npy'", "lists no general/first.npy (store 'general')"),
    ("DELETE FROM files", "lists no general/tokens.npy"),
    ("UPDATE speakers SET utterances = 3 WHERE name = 's1'", "speaker 's1' has 3 utterances, the utterances table 13"),
])
def test_verify_finds_what_opening_need_not(store, statement, message):
    damage(store, statement)
    open_datastore(store)
    with pytest.raises(DatastoreError, match=re.escape(message)):
        open_datastore(store, verify=True)
    assert message in one_line_error("info", "--verify", store)


def test_verify_runs_sqlites_integrity_check(store):
    """Bytes flipped inside a b-tree page: opening may still read what it needs, verify must not pass."""
    path = store / "catalog.sqlite"
    db = sqlite3.connect(path)
    (root_page,) = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'utterances'").fetchone()
    (page_size,) = db.execute("PRAGMA page_size").fetchone()
    db.close()
    data = bytearray(path.read_bytes())
    header = (root_page - 1) * page_size  # the table's root page: its b-tree header and cell pointers
    for i in range(header, header + 64):
        data[i] ^= 0xA5
    path.write_bytes(bytes(data))
    with pytest.raises(DatastoreError, match="integrity check failed|damaged catalog|unreadable catalog"):
        open_datastore(store, verify=True)
    one_line_error("info", "--verify", store)
