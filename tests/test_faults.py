"""Fault injection: builds and enrollments killed (SIGKILL) right after each of their renames leave a store
that opens, old or new, and the next build or enrollment clears what they left; bytes flipped at many
offsets of every store file leave every tool answering or refusing in one line, never crashing.

Kills use the ECHOSPEC_CRASH_AT hook of datastore/files.py (`crash_point`): the child kills itself at the
named point, so each window is hit every time rather than by chance."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from echospec.datastore import build, enroll, open_datastore


def write_corpus(path, seed, n_utts=30, vocab=40):
    rng = np.random.default_rng(seed)
    path.write_text("".join(json.dumps({"id": f"u{i}", "speaker": f"s{i % 2}", "tokens": rng.integers(0, vocab, 30)
                                        .tolist()}) + "\n" for i in range(n_utts)))
    return path


def run_killed_at(point, code):
    """Run `code` in a child that SIGKILLs itself at crash point `point`; it must die there."""
    env = dict(os.environ, ECHOSPEC_CRASH_AT=point)
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, (point, child.returncode, child.stderr[-2000:])


NO_EXCHANGE = "import echospec.datastore.files as files; files._exchange = lambda a, b: False\n"
"""Prefix for a child that takes replace_dir's fallback (move aside, then rename), as without renameat2."""


@pytest.mark.parametrize("point, prefix", [
    ("replace_dir:exchanged", ""),
    ("replace_dir:moved-aside", NO_EXCHANGE),  # no store at the path until the next open recovers it
    ("replace_dir:renamed", NO_EXCHANGE),
])
def test_build_force_killed_after_each_rename_leaves_old_or_new(tmp_path, point, prefix):
    old_corpus, new_corpus = write_corpus(tmp_path / "old.jsonl", 0), write_corpus(tmp_path / "new.jsonl", 1, 20)
    store = tmp_path / "store"
    build(old_corpus, store, faiss=False, progress=False)
    run_killed_at(point, prefix + f"from echospec.datastore import build\n"
                                  f"build({str(new_corpus)!r}, {str(store)!r}, faiss=False, force=True, progress=False)")
    ds = open_datastore(store, verify=True)  # moves back a store the killed build had moved aside
    assert ds.info()["utterances"] == (30 if point == "replace_dir:moved-aside" else 20)
    build(old_corpus, store, faiss=False, force=True, progress=False)  # clears what the killed build left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.jsonl", "old.jsonl", "store"]
    assert open_datastore(store, verify=True).info()["utterances"] == 30


def test_leftover_of_a_killed_replace_is_removed_by_the_next_build(tmp_path):
    """The issue's case: a `.store.old-*` beside a store (earlier versions named it without the pid)."""
    corpus = write_corpus(tmp_path / "c.jsonl", 0)
    store = tmp_path / "store"
    build(corpus, store, faiss=False, progress=False)
    (tmp_path / ".store.old-0123abcd").mkdir()
    (tmp_path / f".store.old-{os.getpid()}-0123abcd").mkdir()  # a live process's: between its renames
    build(corpus, store, faiss=False, force=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".store.old-{os.getpid()}-0123abcd", "c.jsonl", "store"]


@pytest.mark.parametrize("point", ["enroll:renamed", "enroll:committed"])
@pytest.mark.parametrize("replace", [False, True])
def test_enrollment_killed_after_each_step_leaves_old_or_new(tmp_path, point, replace):
    store = tmp_path / "store"
    build(write_corpus(tmp_path / "c.jsonl", 0), store, faiss=False, progress=False)
    (tmp_path / "ann.jsonl").write_text('{"id": "a1", "tokens": [1, 2, 3]}\n')
    enroll(store, "ann", tmp_path / "ann.jsonl")
    (tmp_path / "more.jsonl").write_text('{"id": "a2", "tokens": [4, 5, 6, 7]}\n')
    run_killed_at(point, f"from echospec.datastore import enroll\n"
                         f"enroll({str(store)!r}, 'ann', {str(tmp_path / 'more.jsonl')!r}, replace={replace})")
    ds = open_datastore(store, verify=True)
    segments = [s.tolist() for s in ds.speaker_store("ann").segments()]
    old, new = [[1, 2, 3]], ([[4, 5, 6, 7]] if replace else [[1, 2, 3], [4, 5, 6, 7]])
    assert segments == (old if point == "enroll:renamed" else new)
    assert ds.info()["speakers"]["ann"]["utterances"] == len(segments)
    assert len(list((store / "speakers").iterdir())) == 4  # s0, s1, ann and the killed one's leftover
    (tmp_path / "bob.jsonl").write_text('{"id": "b1", "tokens": [9, 9, 8]}\n')
    enroll(store, "bob", tmp_path / "bob.jsonl")  # the next enrollment clears the leftover
    assert len(list((store / "speakers").iterdir())) == 4  # s0, s1, ann, bob
    assert not list(store.glob(".enroll-*"))
    open_datastore(store, verify=True)
