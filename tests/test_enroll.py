"""Enrollment: a speaker's store is added, appended to or replaced without touching the general
store's files; readers that opened the old store keep working; bad input is refused cleanly."""

import hashlib
import json
import threading

import numpy as np
import pytest
from echospec.datastore import (
    CorpusError,
    DatastoreError,
    build,
    enroll,
    open_datastore,
)
from echospec.retriever import SOURCES, Retriever


def jsonl(path, utterances, speaker=None):
    path.write_text("".join(json.dumps({"speaker": speaker, "tokens": u}) + "\n" for u in utterances))
    return path


def digests(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.parts[len(root.parts)] in ("general", "faiss")}


@pytest.fixture
def store(tmp_path):
    rng = np.random.default_rng(0)
    utts = [rng.integers(0, 40, 30).tolist() for _ in range(30)]
    build(jsonl(tmp_path / "c.jsonl", utts, "old"), tmp_path / "store", vocab_size=50, progress=False)
    return tmp_path / "store"


def speaker_segments(ds, name):
    return [s.tolist() for s in ds.speaker_store(name).segments()]


def test_enroll_adds_a_speaker_and_leaves_general_files_identical(tmp_path, store):
    before = digests(store)
    assert any(name.startswith("faiss/") for name in before)
    # a phrase only the new speaker says: 45 46 47 48 49 (ids unused by the corpus)
    ds = enroll(store, "newbie", jsonl(tmp_path / "n.jsonl", [[45, 46, 47, 48, 49]] * 3))
    assert digests(store) == before
    assert ds.speakers == ("newbie", "old") and ds.info()["speakers"]["newbie"] == {
        "utterances": 3, "tokens": 15, "enrolled_at": ds.info()["speakers"]["newbie"]["enrolled_at"]}
    tree = Retriever(ds, prompt_lookup=False).propose(np.array([45, 46]), speaker="newbie")
    assert tree.tokens[:3].tolist() == [47, 48, 49] and set(tree.sources.tolist()) == {SOURCES.index("speaker")}
    assert open_datastore(store, verify=True).info()["tokens"] == 900  # general counts unchanged


def test_append_then_replace(tmp_path, store):
    enroll(store, "ann", jsonl(tmp_path / "a.jsonl", [[1, 2, 3]]))
    ds = enroll(store, "ann", jsonl(tmp_path / "b.jsonl", [[4, 5], [6, 7]]))
    assert speaker_segments(ds, "ann") == [[1, 2, 3], [4, 5], [6, 7]] and ds.info()["speakers"]["ann"]["utterances"] == 3
    ds = enroll(store, "ann", jsonl(tmp_path / "c.jsonl", [[8, 9]]), replace=True)
    assert speaker_segments(ds, "ann") == [[8, 9]] and ds.info()["speakers"]["ann"]["utterances"] == 1
    assert len(list((store / "speakers").iterdir())) == 2  # old + ann; replaced directories are gone


def test_reader_of_the_old_store_keeps_working(tmp_path, store):
    enroll(store, "ann", jsonl(tmp_path / "a.jsonl", [[1, 2, 3, 4]] * 2))
    reader = Retriever(store, prompt_lookup=False, use_faiss=False)
    before = reader.propose(np.array([1, 2]), speaker="ann").to_dict()
    enroll(store, "ann", jsonl(tmp_path / "b.jsonl", [[1, 2, 9, 9]] * 2), replace=True)
    assert reader.propose(np.array([1, 2]), speaker="ann").to_dict() == before  # old files, old answers
    fresh = Retriever(store, prompt_lookup=False, use_faiss=False)
    assert fresh.propose(np.array([1, 2]), speaker="ann").tokens[0] == 9


def test_reader_that_had_not_mapped_a_replaced_speaker_maps_the_new_one(tmp_path, store):
    enroll(store, "ann", jsonl(tmp_path / "a.jsonl", [[1, 2, 3, 4]] * 2))
    reader = Retriever(store, prompt_lookup=False, use_faiss=False)  # ann not mapped yet
    enroll(store, "ann", jsonl(tmp_path / "b.jsonl", [[1, 2, 9, 9]] * 2), replace=True)
    assert reader.propose(np.array([1, 2]), speaker="ann").tokens[0] == 9


def test_concurrent_enrollments_are_serialised(tmp_path, store):
    files = [jsonl(tmp_path / f"{i}.jsonl", [[i, i + 1]]) for i in range(4)]
    threads = [threading.Thread(target=enroll, args=(store, "ann", f)) for f in files]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(speaker_segments(open_datastore(store), "ann")) == [[i, i + 1] for i in range(4)]


def test_abandoned_enrollment_leftovers_are_cleared(tmp_path, store):
    (store / ".enroll-deadbeef").mkdir()
    (store / "speakers" / "ghost-1234").mkdir()
    enroll(store, "ann", jsonl(tmp_path / "a.jsonl", [[1, 2]]))
    assert not (store / ".enroll-deadbeef").exists() and not (store / "speakers" / "ghost-1234").exists()


def test_bad_enrollments(tmp_path, store):
    before = digests(store)
    with pytest.raises(CorpusError, match=r"o.jsonl:1: token id 50 is outside the speech range 0..49"):
        enroll(store, "ann", jsonl(tmp_path / "o.jsonl", [[1, 50]]))
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(CorpusError, match="corpus is empty"):
        enroll(store, "ann", tmp_path / "e.jsonl")
    with pytest.raises(DatastoreError, match="speaker name ' ' must match"):
        enroll(store, " ", jsonl(tmp_path / "a.jsonl", [[1]]))
    with pytest.raises(DatastoreError, match="no such datastore"):
        enroll(tmp_path / "nowhere", "ann", jsonl(tmp_path / "a.jsonl", [[1]]))
    assert "ann" not in open_datastore(store).speakers and digests(store) == before


def test_enrollment_corpus_is_checked_as_a_whole(tmp_path, store):
    """Duplicate ids within one enrollment are refused; utterances with no speech tokens are skipped.
    Ids already in the catalog are not duplicates: a client may resend an enrollment it saw no answer to."""
    before = digests(store)
    dup = tmp_path / "d.jsonl"
    dup.write_text('{"id": "x", "tokens": [1, 2]}\n{"id": "x", "tokens": [3]}\n')
    with pytest.raises(CorpusError, match=r"d.jsonl:2: utterance id 'x' is already used at .*d.jsonl:1"):
        enroll(store, "ann", dup)
    assert "ann" not in open_datastore(store).speakers and digests(store) == before
    mixed = tmp_path / "m.jsonl"
    mixed.write_text('{"id": "x", "tokens": [1, 2]}\n{"id": "y", "tokens": []}\n')
    assert enroll(store, "ann", mixed).info()["speakers"]["ann"]["utterances"] == 1
    assert enroll(store, "ann", mixed).info()["speakers"]["ann"]["utterances"] == 2


def test_appending_to_a_damaged_speaker_store_is_refused(tmp_path, store):
    """Out-of-vocabulary ids read back from a damaged store would overflow the new store's sort keys."""
    ds = enroll(store, "ann", jsonl(tmp_path / "a.jsonl", [[1, 2, 3, 4]] * 2))
    tokens = np.load(ds.speaker_store("ann").directory / "tokens.npy", mmap_mode="r+")
    tokens[2] = 60_000  # same size, not the sentinel, far outside vocab_size 50
    tokens.flush()
    del tokens
    with pytest.raises(DatastoreError, match="exact store is damaged .a stored id is outside the vocabulary"):
        enroll(store, "ann", jsonl(tmp_path / "b.jsonl", [[5, 6]]))
    enroll(store, "ann", jsonl(tmp_path / "b.jsonl", [[5, 6]]), replace=True)  # replacing needs no old data
    assert speaker_segments(open_datastore(store, verify=True), "ann") == [[5, 6]]
