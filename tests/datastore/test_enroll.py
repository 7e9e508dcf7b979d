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
    EnrollmentConflict,
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
    ds = enroll(store, "newbie", jsonl(tmp_path / "n.jsonl", [[45, 46, 47, 48, 49]] * 3)).datastore
    assert digests(store) == before
    assert ds.speakers == ("newbie", "old") and ds.info()["speakers"]["newbie"] == {
        "utterances": 3, "tokens": 15, "enrolled_at": ds.info()["speakers"]["newbie"]["enrolled_at"]}
    tree = Retriever(ds, prompt_lookup=False).propose(np.array([45, 46]), speaker="newbie")
    assert tree.tokens[:3].tolist() == [47, 48, 49] and set(tree.sources.tolist()) == {SOURCES.index("speaker")}
    assert open_datastore(store, verify=True).info()["tokens"] == 900  # general counts unchanged


def test_append_then_replace(tmp_path, store):
    enroll(store, "ann", jsonl(tmp_path / "a.jsonl", [[1, 2, 3]]))
    ds = enroll(store, "ann", jsonl(tmp_path / "b.jsonl", [[4, 5], [6, 7]])).datastore
    assert speaker_segments(ds, "ann") == [[1, 2, 3], [4, 5], [6, 7]] and ds.info()["speakers"]["ann"]["utterances"] == 3
    ds = enroll(store, "ann", jsonl(tmp_path / "c.jsonl", [[8, 9]]), replace=True).datastore
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


def test_enrollment_corpus_is_checked_as_a_whole(tmp_path, store, caplog):
    """Duplicate ids within one enrollment are refused; utterances with no speech tokens are skipped, and none
    at all is one error, with no warning about what was skipped before it."""
    before = digests(store)
    dup = tmp_path / "d.jsonl"
    dup.write_text('{"id": "x", "tokens": [1, 2]}\n{"id": "x", "tokens": [3]}\n')
    with pytest.raises(CorpusError, match=r"d.jsonl:2: utterance id 'x' is already used at .*d.jsonl:1"):
        enroll(store, "ann", dup)
    assert "ann" not in open_datastore(store).speakers and digests(store) == before
    mixed = tmp_path / "m.jsonl"
    mixed.write_text('{"id": "x", "tokens": [1, 2]}\n{"id": "y", "tokens": []}\n')
    assert enroll(store, "ann", mixed).datastore.info()["speakers"]["ann"]["utterances"] == 1
    caplog.clear()
    with pytest.raises(CorpusError, match=r"^utterances: corpus is empty \(no speech tokens\)$"):
        enroll(store, "ann", [{"id": "z", "tokens": []}])
    assert "skipped" not in caplog.text


# --- a resent enrollment: idempotent by utterance id within a speaker ----------------------------------------


def test_the_same_ids_and_tokens_again_change_nothing(tmp_path, store):
    utterances = [{"id": f"u{i}", "tokens": [i, i + 1, i + 2]} for i in range(5)]
    first = enroll(store, "ann", utterances)
    assert (first.added, first.unchanged) == (5, 0)
    files = digests_of(store / "speakers")
    again = enroll(store, "ann", utterances)
    assert (again.added, again.unchanged) == (0, 5)
    assert digests_of(store / "speakers") == files  # nothing was written
    more = enroll(store, "ann", utterances[3:] + [{"id": "u5", "tokens": [7, 7]}])
    assert (more.added, more.unchanged) == (1, 2)
    assert speaker_segments(more.datastore, "ann") == [u["tokens"] for u in utterances] + [[7, 7]]
    assert open_datastore(store, verify=True).info()["speakers"]["ann"]["utterances"] == 6


def test_a_known_id_with_other_tokens_is_refused_unless_replacing(tmp_path, store):
    enroll(store, "ann", [{"id": "u1", "tokens": [1, 2, 3]}, {"id": "u2", "tokens": [4, 5]}])
    files = digests_of(store / "speakers")
    with pytest.raises(EnrollmentConflict, match=r"^utterances\[1\]: speaker 'ann' already has utterance 'u2' "
                                                 r"with other tokens; nothing was enrolled"):
        enroll(store, "ann", [{"id": "u3", "tokens": [9]}, {"id": "u2", "tokens": [4, 6]}])
    assert digests_of(store / "speakers") == files
    other = enroll(store, "bob", [{"id": "u2", "tokens": [4, 6]}])  # ids are per speaker
    assert other.added == 1
    replaced = enroll(store, "ann", [{"id": "u2", "tokens": [4, 6]}], replace=True)
    assert speaker_segments(replaced.datastore, "ann") == [[4, 6]] and replaced.added == 1


def test_the_same_ids_in_a_file_enrolled_twice_with_the_command_line(tmp_path, store):
    """The issue's case: `echospec enroll st s u.jsonl` twice left two "u1" rows."""
    from click.testing import CliRunner
    from echospec.tools.cli import main

    (tmp_path / "u.jsonl").write_text('{"id": "u1", "tokens": [1, 2, 3]}\n')
    runner = CliRunner()
    first = runner.invoke(main, ["enroll", str(store), "s", str(tmp_path / "u.jsonl")])
    again = runner.invoke(main, ["enroll", str(store), "s", str(tmp_path / "u.jsonl")])
    assert first.exit_code == again.exit_code == 0, again.output
    assert "1 utterances added" in first.output and "0 utterances added; 1 already enrolled" in again.output
    assert open_datastore(store).info()["speakers"]["s"]["utterances"] == 1
    (tmp_path / "u.jsonl").write_text('{"id": "u1", "tokens": [1, 2, 4]}\n')
    changed = runner.invoke(main, ["enroll", str(store), "s", str(tmp_path / "u.jsonl")])
    assert changed.exit_code == 1 and "Traceback" not in changed.output
    assert changed.output.strip().splitlines() == [
        f"Error: {tmp_path / 'u.jsonl'}:1: speaker 's' already has utterance 'u1' with other tokens; nothing was "
        "enrolled (replace the speaker's utterances to change it)"]


def test_concurrent_identical_enrollments_leave_one_copy(tmp_path, store):
    utterances = [{"id": f"u{i}", "tokens": [i, i + 1, i + 2]} for i in range(5)]
    results = []
    threads = [threading.Thread(target=lambda: results.append(enroll(store, "ann", utterances))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted((r.added, r.unchanged) for r in results) == [(0, 5)] * 7 + [(5, 0)]
    ds = open_datastore(store, verify=True)
    assert ds.info()["speakers"]["ann"]["utterances"] == 5
    assert speaker_segments(ds, "ann") == [u["tokens"] for u in utterances]


def test_a_speaker_built_with_the_store_is_idempotent_too(tmp_path):
    """Ids and tokens of a speaker store the build made are read back from it."""
    rows = [{"id": f"b{i}", "speaker": "old", "tokens": [i % 7, 40 + i % 3, 1, 8, 9][: 2 + i % 4]} for i in range(12)]
    rows[3]["tokens"] = [1, 2, 49, 3]  # a stop id splits it: its speech tokens are what is compared
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = build(tmp_path / "c.jsonl", tmp_path / "st", vocab_size=49, stop_ids=[49], faiss=False, progress=False)
    again = enroll(ds.root, "old", [{k: r[k] for k in ("id", "tokens")} for r in rows])
    assert (again.added, again.unchanged) == (0, 12)
    with pytest.raises(EnrollmentConflict, match="'b3'"):
        enroll(ds.root, "old", [{"id": "b3", "tokens": [1, 2, 4]}])


def digests_of(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_appending_to_a_damaged_speaker_store_is_refused(tmp_path, store):
    """Out-of-vocabulary ids read back from a damaged store would overflow the new store's sort keys."""
    ds = enroll(store, "ann", jsonl(tmp_path / "a.jsonl", [[1, 2, 3, 4]] * 2)).datastore
    tokens = np.load(ds.speaker_store("ann").directory / "tokens.npy", mmap_mode="r+")
    tokens[2] = 60_000  # same size, not the sentinel, far outside vocab_size 50
    tokens.flush()
    del tokens
    with pytest.raises(DatastoreError, match="exact store is damaged .a stored id is outside the vocabulary"):
        enroll(store, "ann", jsonl(tmp_path / "b.jsonl", [[5, 6]]))
    enroll(store, "ann", jsonl(tmp_path / "b.jsonl", [[5, 6]]), replace=True)  # replacing needs no old data
    assert speaker_segments(open_datastore(store, verify=True), "ann") == [[5, 6]]
