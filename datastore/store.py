"""Build, enroll into and open a datastore: a directory holding a general exact store, per-speaker
exact stores, an optional FAISS store and the SQLite catalog that describes them.

Layout
  STORE/catalog.sqlite               catalog (see catalog.py); written last, so no catalog = no store
  STORE/general/{tokens,sa,first}.npy
  STORE/speakers/<slug>-<gen>/{tokens,sa,first}.npy   one directory per speaker, replaced whole on enroll
  STORE/faiss/{index.faiss,embeddings.npy}            optional (see faiss_store.py)

Every write goes to a temporary directory, is fsynced and renamed into place (a rebuild exchanges it with
the old datastore in one system call: files.replace_dir), so a build or enrollment killed at any instant
leaves the old datastore or the new one; the next build or enrollment removes what it left behind.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from tqdm import tqdm

from . import catalog
from .corpus import Utterance, Vocabulary, collect, read_corpus, split_segments
from .errors import CorpusError, DatastoreError
from .exact import ExactStore, stream_dtype, write_exact_store
from .files import crash_point, fsync_dir, fsync_tree, process_alive, recover_dir, replace_dir
from .names import check_name

N_MIN = 1
"""Shortest context suffix an exact store matches: a one-token match still beats proposing nothing
(oracle acceptance 2.64 tokens/step at n_min 1, 1.91 at 2; see echospec.retriever.retriever)."""
N_MAX = 8
"""Longest context suffix an exact store sorts and matches to. On speech tokens, matches longer
than 4 rarely have the support the retriever asks for: n_max 4, 8 and 16 score within 0.01
tokens/step, and each extra key word costs the build's radix sort ~6 passes."""

def build(corpus, store_dir, per_speaker: bool = True, faiss: bool = True, embeddings=None,
          speech_offset: int = 0, vocab_size: int | None = None, stop_ids: Iterable[int] = (),
          drop_ids: Iterable[int] = (), codebooks: int = 1, n_min: int = N_MIN, n_max: int = N_MAX,
          force: bool = False, progress: bool = True, faiss_options: dict | None = None) -> Datastore:
    """Build a datastore from a corpus (JSONL, JSONL manifest of .npy, or .npz; see corpus.py).

    `speech_offset`, `vocab_size` and `stop_ids` map raw model ids to store-local speech ids
    (local = raw - speech_offset, 0 <= local < vocab_size; stop ids end a segment and are never
    stored); `drop_ids` are marker ids removed wherever they occur. `codebooks` > 1 records that the
    speech ids interleave that many codebooks (local id // (vocab_size / codebooks) is the codebook,
    codebooks cycling in order), so retrievers propose only ids valid at the next position.
    `per_speaker` builds one exact store per speaker besides the general one; `faiss`
    adds a FAISS store whose context vectors come from `embeddings` (a .npy or .safetensors table)
    or, when None, from the corpus. An existing `store_dir` is replaced only with `force`.
    """
    _check_build_options(vocab_size, speech_offset, n_min, n_max, codebooks)
    target = Path(store_dir)
    recover_dir(target)  # a replace killed between its renames (where the exchange is not available)
    _check_target(target, force)
    if faiss and embeddings is not None and not Path(embeddings).is_file():
        raise DatastoreError(f"{embeddings}: embedding file not found")
    vocab = Vocabulary(int(speech_offset), None if vocab_size is None else int(vocab_size),
                       tuple(int(s) for s in stop_ids), tuple(int(d) for d in drop_ids))
    started = time.perf_counter()
    bar = tqdm(desc="reading corpus", unit=" utt", disable=not progress, leave=False)
    utterances = collect(_counted(read_corpus(corpus, vocab), bar), per_speaker)
    bar.close()
    segments = [split_segments(u.tokens) for u in utterances]
    n_tokens = sum(len(s) for segs in segments for s in segs)
    if n_tokens == 0:
        raise CorpusError(f"{_corpus_name(corpus)}: corpus is empty (no speech tokens)")
    if vocab.size is None:
        largest = max(int(s.max()) for segs in segments for s in segs)
        vocab = Vocabulary(vocab.speech_offset, -(-(largest + 1) // codebooks) * codebooks, vocab.stop_ids,
                           vocab.drop_ids)
    split = [_split_layout_breaks(segs, vocab.size, codebooks) for segs in segments]
    segments, layout_breaks = [segs for segs, _ in split], sum(n for _, n in split)
    speakers = _group_by_speaker(utterances, segments) if per_speaker else {}
    for name in speakers:
        try:
            check_name("speaker", name)
        except DatastoreError as e:
            raise CorpusError(f"{_corpus_name(corpus)}: {e}; rename the speaker in the corpus, or build with "
                              f"per_speaker=False (--no-per-speaker)") from None
    _remove_abandoned_builds(target)
    tmp = target.parent / f".{target.name}.building-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        steps = tqdm(total=1 + len(speakers) + bool(faiss), desc="building", unit=" store",
                     disable=not progress)
        db = catalog.create(tmp, _meta(vocab, codebooks, n_min, n_max, per_speaker, faiss, corpus))
        all_segments = [s for segs in segments for s in segs]
        steps.set_description("general store")
        counts = write_exact_store(tmp / "general", all_segments, vocab.size, n_max)
        _record_store(db, tmp, "general", tmp / "general", None, len(utterances), counts)
        steps.update()
        for name, (utts, segs) in speakers.items():
            steps.set_description(f"speaker {name}")
            directory = tmp / "speakers" / _speaker_dir(name)
            counts = write_exact_store(directory, segs, vocab.size, n_max)
            _record_store(db, tmp, f"speaker:{name}", directory, name, len(utts), counts)
            steps.update()
        if faiss:
            steps.set_description("faiss store")
            from .faiss_store import write_faiss_store
            info = write_faiss_store(tmp / "faiss", tmp / "general", vocab.size, embeddings,
                                     speech_offset=vocab.speech_offset, **(faiss_options or {}))
            _record_store(db, tmp, "faiss", tmp / "faiss", None, len(utterances),
                          {"tokens": info.pop("vectors"), "segments": 0}, kind="faiss", params=info)
            steps.update()
        _insert_utterances(db, utterances)
        catalog.set_meta(db, {"build_seconds": round(time.perf_counter() - started, 3),
                              "layout_breaks": layout_breaks})
        catalog.finish(db, tmp)
        fsync_tree(tmp)
        steps.close()
        replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return open_datastore(target)


def enroll(store_dir, speaker: str, corpus, replace: bool = False) -> Datastore:
    """Add utterances to one speaker's store (or replace it with `replace`), leaving every other
    store's files untouched. Crash-safe: the new store is written to a temporary directory, fsynced
    and renamed into place, and its catalog rows change in one transaction; a reader that opened the
    old store keeps its memory maps (the old files' inodes) until it reopens. Every utterance of
    `corpus` is filed under `speaker`, whatever its own "speaker" field says."""
    root = Path(store_dir)
    check_name("speaker", speaker)
    with _locked(root):
        ds = open_datastore(root)
        _remove_abandoned_enrollments(ds)
        vocab = Vocabulary(ds.speech_offset, ds.vocab_size, ds.stop_ids, ds.drop_ids)
        new = collect(read_corpus(corpus, vocab), per_speaker=False)
        segments = [s for u in new for s in split_segments(u.tokens)]
        if not segments:
            raise CorpusError(f"{_corpus_name(corpus)}: corpus is empty (no speech tokens)")
        segments, _ = _split_layout_breaks(segments, ds.vocab_size, ds.codebooks)
        old_dir = ds._speaker_dirs.get(speaker)
        old_rows = ds.catalog_speaker(speaker)
        if old_dir is not None and not replace:
            segments = ds.speaker_store(speaker).segments() + segments
        n_utts = len(new) + (old_rows["utterances"] if old_rows and not replace else 0)
        final = root / "speakers" / _speaker_dir(speaker)
        tmp = root / f".enroll-{uuid.uuid4().hex[:8]}"
        try:
            counts = write_exact_store(tmp, segments, ds.vocab_size, ds.sort_depth)
            fsync_tree(tmp)
            final.parent.mkdir(exist_ok=True)
            os.rename(tmp, final)
            crash_point("enroll:renamed")
            fsync_dir(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        with catalog.opened(root) as db, db.atomic():  # one transaction: the old store or the new one
            _record_store(db, root, f"speaker:{speaker}", final, speaker, n_utts, counts)
            if replace:
                db["utterances"].delete_where("speaker = ?", [speaker])
            for u in new:
                u.speaker = speaker
            _insert_utterances(db, new)
            catalog.set_meta(db, {"updated_at": catalog.now()})
        crash_point("enroll:committed")
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)
    return open_datastore(root)


def open_datastore(store_dir, verify: bool = False) -> Datastore:
    """Open a datastore: read and check the catalog (format version, the rows a reader follows) and
    every file's size, and memory-map the general store; speaker stores map on first use. `verify`
    adds SQLite's integrity check, every file's sha256 and the catalog's own consistency (catalog.read)."""
    return Datastore(Path(store_dir), verify)


class Datastore:
    """An open datastore. Thread-safe for reads; stores are memory-mapped."""

    def __init__(self, root: Path, verify: bool = False):
        self.root = root
        contents = catalog.read(root, verify)
        self.meta, self._stores, self._speakers, self._files = (contents.meta, contents.stores, contents.speakers,
                                                                contents.files)
        self.vocab_size = int(self.meta["vocab_size"])
        self.speech_offset = int(self.meta["speech_offset"])
        self.stop_ids = tuple(self.meta["stop_ids"])
        self.drop_ids = tuple(self.meta.get("drop_ids", ()))
        self.codebooks = int(self.meta.get("codebooks", 1))  # stores built before codebooks existed have one
        self.n_min, self.n_max = int(self.meta["n_min"]), int(self.meta["n_max"])
        self.sort_depth = int(self.meta["sort_depth"])
        self._speaker_dirs = {name: root / self._stores[row["store"]]["directory"]
                              for name, row in self._speakers.items()}
        self.general = ExactStore(root / self._stores["general"]["directory"], self.vocab_size)
        self._speaker_stores: dict[str, ExactStore] = {}
        self._faiss = None
        self._lock = threading.Lock()

    @property
    def speakers(self) -> tuple[str, ...]:
        return tuple(sorted(self._speakers))

    @property
    def has_faiss(self) -> bool:
        return "faiss" in self._stores

    def speaker_store(self, speaker: str) -> ExactStore | None:
        """The speaker's exact store, or None for an unknown speaker."""
        store = self._speaker_stores.get(speaker)
        if store is None and speaker in self._speaker_dirs:
            with self._lock:
                store = self._speaker_stores.get(speaker)
                if store is None:
                    store = self._map_speaker(speaker)
                    self._speaker_stores[speaker] = store
        return store

    def _map_speaker(self, speaker: str) -> ExactStore:
        """Map on first use; if an enrollment replaced the store since this datastore was opened
        (its old directory is gone), map the one the catalog names now."""
        try:
            return ExactStore(self._speaker_dirs[speaker], self.vocab_size)
        except DatastoreError:
            with catalog.opened(self.root) as db:
                row = db.execute("SELECT s.directory FROM speakers p JOIN stores s ON s.name = p.store "
                                 "WHERE p.name = ?", [speaker]).fetchone()
            if row is None or not catalog.inside(row[0]):
                raise
            return ExactStore(self.root / row[0], self.vocab_size)

    def faiss_store(self):
        """The FAISS store, or None when the datastore was built without one."""
        if self._faiss is None and self.has_faiss:
            with self._lock:
                if self._faiss is None:
                    from .faiss_store import open_faiss_store
                    row = self._stores["faiss"]
                    self._faiss = open_faiss_store(self.root / row["directory"], row["params"], self.vocab_size)
        return self._faiss

    def catalog_speaker(self, speaker: str) -> dict | None:
        return self._speakers.get(speaker)

    def verify(self) -> None:
        """Everything `open_datastore(verify=True)` checks (see catalog.read); raises DatastoreError."""
        catalog.read(self.root, verify=True)

    def info(self) -> dict:
        """Everything the catalog knows, as JSON-ready data (what `echospec info --json` prints)."""
        stores = []
        for row in sorted(self._stores.values(), key=lambda r: (r["kind"] != "exact", r["name"] != "general",
                                                                 r["name"])):
            entry = {k: row[k] for k in ("name", "kind", "directory", "speaker", "utterances", "tokens",
                                         "bytes", "created_at")}
            entry["params"] = row["params"]
            if row["kind"] == "exact":
                entry["bytes_per_token"] = round(row["bytes"] / max(row["tokens"], 1), 3)
            else:
                entry["vectors"] = entry.pop("tokens")
            stores.append(entry)
        general = self._stores["general"]
        meta = self.meta
        return {
            "path": str(self.root),
            "format_version": meta["format_version"],
            "vocabulary": {"speech_offset": self.speech_offset, "size": self.vocab_size,
                           "stop_ids": list(self.stop_ids), "drop_ids": list(self.drop_ids),
                           "codebooks": self.codebooks, "dtype": meta["dtype"]},
            "n_min": self.n_min, "n_max": self.n_max,
            "utterances": general["utterances"], "tokens": general["tokens"],
            "speakers": {name: {"utterances": r["utterances"], "tokens": r["tokens"],
                                "enrolled_at": r["enrolled_at"]} for name, r in sorted(self._speakers.items())},
            "exact_bytes": sum(r["bytes"] for r in self._stores.values() if r["kind"] == "exact"),
            "general_bytes_per_token": round(general["bytes"] / max(general["tokens"], 1), 3),
            "faiss_bytes": sum(r["bytes"] for r in self._stores.values() if r["kind"] == "faiss"),
            "stores": stores,
            "files": self._files,
            "build": meta.get("build", {}),
            "build_seconds": meta.get("build_seconds"),
            "created_at": meta["created_at"], "updated_at": meta["updated_at"],
        }

    def __repr__(self) -> str:
        return (f"Datastore({str(self.root)!r}, tokens={self._stores['general']['tokens']}, "
                f"speakers={len(self._speakers)}, faiss={self.has_faiss})")


def _check_build_options(vocab_size, speech_offset, n_min, n_max, codebooks) -> None:
    if vocab_size is not None and not (0 < int(vocab_size) < 2**32 - 1):
        raise DatastoreError(f"vocab_size must be between 1 and {2**32 - 2}, got {vocab_size}")
    if int(codebooks) < 1 or (vocab_size is not None and int(vocab_size) % int(codebooks)):
        raise DatastoreError(f"codebooks must be >= 1 and divide vocab_size, got {codebooks} and {vocab_size}")
    if int(speech_offset) < 0:
        raise DatastoreError(f"speech_offset must be >= 0, got {speech_offset}")
    if not 1 <= int(n_min) <= int(n_max) <= 64:
        raise DatastoreError(f"need 1 <= n_min <= n_max <= 64, got n_min={n_min}, n_max={n_max}")


def _check_target(target: Path, force: bool) -> None:
    if not target.exists():
        return
    if not force:
        raise DatastoreError(f"{target}: already exists (use --force / force=True to replace it)")
    is_store = (target / catalog.CATALOG).is_file()
    if not target.is_dir() or not (is_store or not any(target.iterdir())):
        raise DatastoreError(f"{target}: exists and is not a datastore; refusing to replace it")


def _remove_abandoned_enrollments(ds: Datastore) -> None:
    """Under the writer lock: temporary or unreferenced speaker directories are leftovers of an
    enrollment killed before its catalog transaction; no reader can be using them."""
    for tmp in ds.root.glob(".enroll-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    referenced = {path.resolve() for path in ds._speaker_dirs.values()}
    for directory in (ds.root / "speakers").glob("*"):
        if directory.resolve() not in referenced:
            shutil.rmtree(directory, ignore_errors=True)


def _remove_abandoned_builds(target: Path) -> None:
    """Delete temporary directories of earlier builds of `target` whose process is gone (killed)."""
    for tmp in target.parent.glob(f".{target.name}.building-*"):
        pid = tmp.name.rsplit("-", 2)[-2]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _counted(items, bar):
    for item in items:
        bar.update()
        yield item


def _corpus_name(corpus) -> str:
    return str(corpus) if isinstance(corpus, (str, Path)) else ", ".join(map(str, corpus))


def _group_by_speaker(utterances: list[Utterance], segments: list[list[np.ndarray]]) -> dict:
    groups: dict[str, tuple[list, list]] = {}
    for utt, segs in zip(utterances, segments):
        utts, all_segs = groups.setdefault(utt.speaker, ([], []))
        utts.append(utt)
        all_segs.extend(segs)
    return dict(sorted(groups.items()))


def _split_layout_breaks(segments: list[np.ndarray], vocab_size: int, codebooks: int) -> tuple[list[np.ndarray], int]:
    """With interleaved codebooks, a token must be in the codebook after its predecessor's (cyclically):
    split segments where one is not (a lost token), so no stored continuation crosses a break. Returns the
    segments and the number of breaks."""
    if codebooks == 1:
        return segments, 0
    width, out, breaks = vocab_size // codebooks, [], 0
    for seg in segments:
        book = seg // width
        cuts = np.flatnonzero(book[1:] != (book[:-1] + 1) % codebooks) + 1
        breaks += len(cuts)
        out.extend(np.split(seg, cuts) if len(cuts) else [seg])
    return out, breaks


def _meta(vocab: Vocabulary, codebooks, n_min, n_max, per_speaker, faiss, corpus) -> dict:
    return {"vocab_size": vocab.size, "speech_offset": vocab.speech_offset, "stop_ids": list(vocab.stop_ids),
            "drop_ids": list(vocab.drop_ids), "codebooks": int(codebooks),
            "dtype": stream_dtype(vocab.size).name, "n_min": int(n_min), "n_max": int(n_max),
            "sort_depth": int(n_max),
            "build": {"corpus": _corpus_name(corpus), "per_speaker": per_speaker, "faiss": bool(faiss)}}


def _speaker_dir(name: str) -> str:
    """A file-system-safe, unique, fresh directory name for a speaker's store."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:40].strip(".") or "speaker"
    tag = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{slug}-{tag}-{uuid.uuid4().hex[:8]}"


def _record_store(db, root: Path, name: str, directory: Path, speaker: str | None, n_utts: int,
                  counts: dict, kind: str = "exact", params: dict | None = None) -> None:
    size = catalog.record_files(db, root, name, directory)
    stamp = catalog.now()
    db["stores"].upsert({"name": name, "kind": kind, "directory": directory.relative_to(root).as_posix(),
                         "speaker": speaker, "utterances": n_utts, "segments": counts["segments"],
                         "tokens": counts["tokens"], "bytes": size, "created_at": stamp,
                         "params": json.dumps(params or {})}, pk="name")
    if speaker is not None:
        db["speakers"].upsert({"name": speaker, "store": name, "utterances": n_utts, "tokens": counts["tokens"],
                               "enrolled_at": stamp}, pk="name")


def _insert_utterances(db, utterances: list[Utterance]) -> None:
    # Plain executemany: sqlite-utils' per-row type handling cost 2 s for a 10M-token corpus.
    with db.atomic():
        db.conn.executemany(
            "INSERT INTO utterances (id, speaker, tokens, source, extra) VALUES (?, ?, ?, ?, ?)",
            ((u.id, u.speaker, int((u.tokens >= 0).sum()), u.where, json.dumps(u.extra) if u.extra else None)
             for u in utterances))


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
