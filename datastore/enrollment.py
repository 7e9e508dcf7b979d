"""Enroll a speaker: add utterances to one speaker's exact store, or replace it, leaving every other store's
files untouched.

Idempotent by utterance id within a speaker, so a client may resend an enrollment it saw no answer to: an
id the speaker already has with the same speech tokens is left as it is (counted as unchanged), one with
other tokens is refused (EnrollmentConflict; nothing is written) unless the speaker's utterances are
replaced. Ids a corpus file does not give ("<file stem>:<line>") are not compared. Writers of one datastore
take turns (a file lock), so identical enrollments sent at once leave one copy.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import catalog
from .corpus import UniqueIds, Utterance, Vocabulary, corpus_files, corpus_units, counted_local_ids, has_speech, \
    read_batches, split_layout_breaks, split_segments, warn_dropped, warn_skipped
from .errors import CorpusError, DatastoreError, EnrollmentConflict
from .exact import write_exact_store
from .files import atomic_dir, crash_point
from .names import check_name
from .store import Datastore, open_datastore
from .tasks import speaker_dir


@dataclass(frozen=True)
class Enrollment:
    """What an enrollment did: `added` utterances stored, `unchanged` ones the speaker already had."""

    datastore: Datastore  # the datastore opened after the enrollment
    speaker: str
    added: int
    unchanged: int
    replaced: bool
    dropped_non_speech: int = 0  # ids outside the speech range removed (a datastore built with drop_non_speech)


def enroll(store_dir, speaker: str, utterances, replace: bool = False) -> Enrollment:
    """Add utterances to one speaker's store (or replace it with `replace`). `utterances` is a corpus (files or
    glob patterns, see corpus.py) or an iterable of dicts `{"id": ..., "tokens": [raw model ids], ...}`; each
    is filed under `speaker`, whatever its own "speaker" field says.

    Crash-safe: the new store is written to a temporary directory, fsynced and renamed into place, and its
    catalog rows change in one transaction; a reader that opened the old store keeps its memory maps (the
    old files' inodes) until it reopens."""
    root = Path(store_dir)
    check_name("speaker", speaker)
    with _locked(root):
        ds = open_datastore(root)
        _remove_abandoned_enrollments(ds)
        vocab = Vocabulary(ds.speech_offset, ds.vocab_size, ds.stop_ids, ds.drop_ids, ds.drop_non_speech)
        dropped = _Dropped()
        new = _checked(*_read(utterances, vocab, dropped))
        dropped.warn(vocab)
        old_dir = ds.speaker_directory(speaker)
        appending = old_dir is not None and not replace
        kept = ds.speaker_store(speaker).segments() if appending else []
        unchanged = 0
        if appending:
            new, unchanged = _not_yet_enrolled(new, _enrolled(root, ds, speaker, kept), speaker)
            if not new:
                return Enrollment(ds, speaker, 0, unchanged, replace, dropped.tokens)
        added, _ = split_layout_breaks([s for u in new for s in split_segments(u.tokens)], ds.vocab_size,
                                       ds.codebooks)
        n_utts = len(new) + (ds.catalog_speaker(speaker)["utterances"] if appending else 0)
        final = root / "speakers" / speaker_dir(speaker)
        with atomic_dir(final, tag="enroll") as tmp:
            counts = write_exact_store(tmp, kept + added, ds.vocab_size, ds.sort_depth)
        crash_point("enroll:renamed")
        with catalog.opened(root) as db, db.atomic():  # one transaction: the old store or the new one
            catalog.record_store(db, root, f"speaker:{speaker}", final, speaker, n_utts, counts)
            if replace:
                catalog.remove_utterances(db, speaker)
            catalog.insert_utterances(db, ((u.id, speaker, int((u.tokens >= 0).sum()), u.where, _extra(u))
                                           for u in new))
            catalog.set_meta(db, {"updated_at": catalog.now()})
        crash_point("enroll:committed")
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)
    return Enrollment(open_datastore(root), speaker, len(new), unchanged, replace, dropped.tokens)


@dataclass
class _Dropped:
    """Ids outside the speech range an enrollment removed (drop_non_speech), for one warning as a build gives."""

    tokens: int = 0
    utterances: int = 0
    first: str | None = None

    def add(self, tokens: int, utterances: int, first: str | None) -> None:
        self.tokens += tokens
        self.utterances += utterances
        self.first = self.first or first

    def warn(self, vocab: Vocabulary) -> None:
        if self.tokens:
            warn_dropped(self.first, self.tokens, self.utterances, vocab)


def _read(utterances, vocab: Vocabulary, dropped: _Dropped) -> tuple[Iterable[Utterance], str]:
    """The utterances of a corpus (paths) or of dicts, checked and mapped to local ids, and what to call them."""
    if isinstance(utterances, (str, os.PathLike)):
        return _read_files(utterances, vocab, dropped), str(utterances)
    utterances = list(utterances)
    if all(isinstance(u, (str, os.PathLike)) for u in utterances):
        return _read_files(utterances, vocab, dropped), catalog.corpus_name(utterances)
    return (_from_dict(row, i, vocab, dropped) for i, row in enumerate(utterances)), "utterances"


def _read_files(paths, vocab: Vocabulary, dropped: _Dropped) -> Iterator[Utterance]:
    for unit in corpus_units(corpus_files(paths)):
        for batch in read_batches(unit, vocab):
            dropped.add(batch.dropped_tokens, batch.dropped_utterances, batch.first_dropped)
            yield from batch.utterances()


def _from_dict(row, index: int, vocab: Vocabulary, dropped: _Dropped) -> Utterance:
    where = f"utterances[{index}]"
    if not isinstance(row, Mapping):
        raise CorpusError(f"{where}: expected a dict with 'tokens' (or give corpus files), got {type(row).__name__}")
    if "tokens" not in row:
        raise CorpusError(f"{where}: utterance has no 'tokens'")
    uid = row.get("id")
    if uid is not None and not isinstance(uid, (str, int)):
        raise CorpusError(f"{where}: 'id' must be a string")
    extra = {k: v for k, v in row.items() if k not in ("id", "speaker", "tokens")}
    tokens = row["tokens"]
    tokens = list(tokens) if isinstance(tokens, tuple) else tokens
    local, removed = counted_local_ids(tokens, where, vocab)
    dropped.add(removed, int(removed > 0), where if removed else None)
    return Utterance(where if uid is None else str(uid), None, local, where, extra, id_given=uid is not None)


def _checked(utterances: Iterable[Utterance], name: str) -> list[Utterance]:
    """An enrollment's utterances, checked as a whole as a build checks its corpus: a repeated id is refused,
    and utterances with no speech tokens are skipped with one warning (none at all is an error)."""
    kept, skipped, ids = [], [], UniqueIds()
    for utt in utterances:
        if utt.id_given:
            ids.add(utt.id, utt.where)
        (kept if has_speech(utt) else skipped).append(utt)
    if not kept:
        raise CorpusError(f"{name}: corpus is empty (no speech tokens)")
    if skipped:
        warn_skipped(skipped[0].where, len(skipped))
    return kept


def _enrolled(root: Path, ds: Datastore, speaker: str, segments: list[np.ndarray]) -> dict[str, list[np.ndarray]]:
    """The speech tokens of each utterance id in the speaker's store. The store holds its utterances' segments
    in the order of their catalog rows, so each row's token count cuts the stream."""
    with catalog.opened(root) as db:
        rows = catalog.speaker_utterances(db, speaker)
    rows = rows[len(rows) - ds.catalog_speaker(speaker)["utterances"]:]  # a build without speaker stores
    stream = np.concatenate(segments) if segments else np.zeros(0, np.int64)  # filed rows for the general store
    if sum(n for _, n in rows) != len(stream):
        raise DatastoreError(f"{root / catalog.CATALOG}: speaker {speaker!r}'s utterance rows hold "
                             f"{sum(n for _, n in rows)} tokens, its store {len(stream)}; the catalog is inconsistent")
    enrolled: dict[str, list[np.ndarray]] = {}
    start = 0
    for uid, n in rows:
        enrolled.setdefault(uid, []).append(stream[start:start + n])
        start += n
    return enrolled


def _not_yet_enrolled(new: list[Utterance], enrolled: dict[str, list[np.ndarray]],
                      speaker: str) -> tuple[list[Utterance], int]:
    """The utterances the speaker does not have yet, and how many it has already; raises EnrollmentConflict
    for an id it has with other tokens."""
    added = []
    for utt in new:
        if not utt.id_given or utt.id not in enrolled:
            added.append(utt)
            continue
        speech = utt.tokens[utt.tokens >= 0]
        if not any(np.array_equal(speech, tokens) for tokens in enrolled[utt.id]):
            raise EnrollmentConflict(f"{utt.where}: speaker {speaker!r} already has utterance {utt.id!r} with other "
                                     "tokens; nothing was enrolled (replace the speaker's utterances to change it)")
    return added, len(new) - len(added)


def _extra(utt: Utterance) -> str | None:
    return json.dumps(utt.extra, default=str) if utt.extra else None


def _remove_abandoned_enrollments(ds: Datastore) -> None:
    """Under the writer lock: temporary or unreferenced speaker directories are leftovers of an
    enrollment killed before its catalog transaction; no reader can be using them."""
    for tmp in ds.root.glob(".enroll-*"):  # where versions before atomic_dir wrote them
        shutil.rmtree(tmp, ignore_errors=True)
    referenced = {ds.speaker_directory(name).resolve() for name in ds.speakers}
    for directory in (ds.root / "speakers").glob("*"):
        if directory.resolve() not in referenced:
            shutil.rmtree(directory, ignore_errors=True)


@contextmanager
def _locked(root: Path):
    """Serialise writers of one datastore (two enrolls must not both append to the same old store)."""
    if not (root / catalog.CATALOG).is_file():
        open_datastore(root)  # raises the right error
    with open(root / ".lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
