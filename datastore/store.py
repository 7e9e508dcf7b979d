"""Build, enroll into and open a datastore: a directory holding a general exact store, per-speaker
exact stores, an optional FAISS store and the SQLite catalog that describes them.

Layout
  STORE/catalog.sqlite               catalog (see catalog.py); written last, so no catalog = no store
  STORE/general/{tokens,sa,first}.npy                 the general store, when it is one shard
  STORE/general/shard-NNNNN/{tokens,sa,first}.npy     ... its shards, when there are several
  STORE/speakers/<slug>-<gen>/{tokens,sa,first}.npy   one directory per speaker, replaced whole on enroll
  STORE/faiss/{index.faiss,embeddings.npy}            optional (see faiss_store.py)

Every write goes to a temporary directory, is fsynced and renamed into place (a rebuild exchanges it with
the old datastore in one system call: files.replace_dir), so a build or enrollment killed at any instant
leaves the old datastore or the new one; the next build or enrollment removes what it left behind. A
build's tasks (reading the corpus, each shard, each group of speaker stores) run in parallel: see
pipeline.py and tasks.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from . import catalog, pipeline
from .corpus import Vocabulary, collect, corpus_files, read_corpus, split_layout_breaks, split_segments
from .errors import CorpusError, DatastoreError
from .exact import ExactStore, stream_dtype, write_exact_store
from .files import crash_point, fsync_dir, fsync_tree, process_alive, recover_dir, replace_dir
from .names import check_name
from .tasks import speaker_dir, unpack_strings

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
          force: bool = False, progress: bool = True, faiss_options: dict | None = None, shards: int = 1,
          ray: str | None = None, workers: int | None = None) -> Datastore:
    """Build a datastore from a corpus: files or glob patterns (JSONL, JSONL manifest of .npy, .npz,
    Parquet; see corpus.py).

    `speech_offset`, `vocab_size` and `stop_ids` map raw model ids to store-local speech ids
    (local = raw - speech_offset, 0 <= local < vocab_size; stop ids end a segment and are never
    stored); `drop_ids` are marker ids removed wherever they occur. `codebooks` > 1 records that the
    speech ids interleave that many codebooks (local id // (vocab_size / codebooks) is the codebook,
    codebooks cycling in order), so retrievers propose only ids valid at the next position.
    `per_speaker` builds one exact store per speaker besides the general one; `faiss`
    adds a FAISS store whose context vectors come from `embeddings` (a .npy or .safetensors table)
    or, when None, from the corpus. An existing `store_dir` is replaced only with `force`.

    `shards` splits the general store into that many exact stores by a stable hash of each utterance's
    id, so the corpus may exceed one store's 2^31 - 2 tokens; the retriever answers over them as over one
    store. The build's tasks (read the corpus, build each shard, build each group of speaker stores) run
    in this process, in `workers` local processes (default: one per shard, up to the cores and as many as
    memory holds) or, with `ray` ("auto": the running cluster, else a local one; or a cluster address), on
    Ray: Ray Data reads the corpus and each store is one Ray task with its memory reserved. A build that
    fails or is interrupted leaves no datastore, only its finished work beside the target (a hidden
    `.STORE.work-*` directory), which running the same build again reuses.
    """
    _check_build_options(vocab_size, speech_offset, n_min, n_max, codebooks)
    if not 1 <= int(shards) <= 65536:
        raise DatastoreError(f"shards must be between 1 and 65536, got {shards}")
    if workers is not None and int(workers) < 1:
        raise DatastoreError(f"workers must be at least 1, got {workers}")
    if workers is not None and ray is not None:
        raise DatastoreError("workers sets local processes; on Ray the cluster's CPUs run the tasks (drop one)")
    target = Path(store_dir)
    recover_dir(target)  # a replace killed between its renames (where the exchange is not available)
    _check_target(target, force)
    if faiss and embeddings is not None and not Path(embeddings).is_file():
        raise DatastoreError(f"{embeddings}: embedding file not found")
    vocab = Vocabulary(int(speech_offset), None if vocab_size is None else int(vocab_size),
                       tuple(int(s) for s in stop_ids), tuple(int(d) for d in drop_ids))
    started = time.perf_counter()
    files = corpus_files(corpus)
    shards, codebooks = int(shards), int(codebooks)
    work = pipeline.work_dir(target, files, {"speech_offset": vocab.speech_offset, "vocab_size": vocab.size,
                                             "stop_ids": vocab.stop_ids, "drop_ids": vocab.drop_ids,
                                             "codebooks": codebooks, "depth": int(n_max), "shards": shards,
                                             "per_speaker": bool(per_speaker)})
    _remove_abandoned_builds(target)
    runner = pipeline.make_runner(ray, workers, shards)
    try:
        outcome = pipeline.run(work, files, vocab, codebooks, shards, per_speaker, int(n_max), runner, progress)
    except CorpusError:
        shutil.rmtree(work, ignore_errors=True)  # the corpus must change: nothing here will be reused
        raise
    finally:
        runner.close()
    _assemble(target, work, outcome, codebooks, n_min, n_max, per_speaker, faiss, embeddings, faiss_options, corpus,
              started)
    for leftover in target.parent.glob(f".{target.name}.work-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    return open_datastore(target)


def _assemble(target: Path, work: Path, outcome, codebooks, n_min, n_max, per_speaker, faiss, embeddings,
              faiss_options, corpus, started: float) -> None:
    """The datastore from the finished tasks: their stores linked in, the catalog written, the FAISS store
    built over the shards, all in a temporary directory renamed to `target` once complete."""
    vocab = outcome.vocab
    tmp = target.parent / f".{target.name}.building-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        db = catalog.create(tmp, _meta(vocab, codebooks, n_min, n_max, per_speaker, faiss, corpus,
                                       len(outcome.shards)))
        speaker_utterances = _insert_utterances(db, _partition_rows(work, outcome.units))
        shard_dirs = _place_shards(db, tmp, work, outcome)
        for group, manifest in enumerate(outcome.groups):
            for row in manifest["speakers"]:
                source = work / "speakers" / f"group-{group:05d}" / row["directory"]
                _place_store(db, tmp, f"speaker:{row['name']}", source, tmp / "speakers" / row["directory"],
                             row["name"], speaker_utterances[row["name"]], row)
        if faiss:
            from .faiss_store import write_faiss_store
            info = write_faiss_store(tmp / "faiss", shard_dirs, vocab.size, embeddings,
                                     speech_offset=vocab.speech_offset, **(faiss_options or {}))
            _record_store(db, tmp, "faiss", tmp / "faiss", None, sum(u["utterances"] for u in outcome.units),
                          {"tokens": info.pop("vectors"), "segments": 0}, kind="faiss", params=info)
        catalog.set_meta(db, {"build_seconds": round(time.perf_counter() - started, 3),
                              "build_phases": outcome.seconds, "build_tasks": _task_report(outcome),
                              "layout_breaks": outcome.layout_breaks})
        catalog.finish(db, tmp)
        fsync_tree(tmp)
        replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _task_report(outcome) -> list[dict]:
    """Where and how each store task ran (its worker process's peak memory), for `info --json` and benchmarks."""
    tasks = [{"task": f"shard {m['shard']}", "tokens": m["tokens"]} | m for m in outcome.shards]
    tasks += [{"task": f"speakers {m['group']}", "tokens": sum(s["tokens"] for s in m["speakers"])} | m
              for m in outcome.groups]
    keep = ("task", "tokens", "host", "pid", "seconds", "peak_rss_bytes")
    return [{k: t[k] for k in keep} for t in tasks]


def _place_shards(db, tmp: Path, work: Path, outcome) -> list[Path]:
    """Link every shard into the new datastore (general/ itself when there is one shard, else
    general/shard-NNNNN/) and record it; returns their directories."""
    n = len(outcome.shards)
    directories = [tmp / "general" if n == 1 else tmp / "general" / f"shard-{i:05d}" for i in range(n)]
    total = {"utterances": 0, "segments": 0, "tokens": 0, "bytes": 0}
    stamp = catalog.now()
    for i, (manifest, directory) in enumerate(zip(outcome.shards, directories)):
        _link_files(work / "shards" / f"shard-{i:05d}", directory, manifest["files"])
        rows = _file_rows(tmp, "general", directory, manifest["files"])
        db["files"].insert_all(rows, pk="path")
        utterances = sum(u["shard_utterances"][i] for u in outcome.units)
        size = sum(r["bytes"] for r in rows)
        db["shards"].insert({"store": "general", "shard": i, "directory": directory.relative_to(tmp).as_posix(),
                             "utterances": utterances, "segments": manifest["segments"],
                             "tokens": manifest["tokens"], "bytes": size, "sha256": catalog.shard_digest(rows),
                             "created_at": stamp})
        for key, value in (("utterances", utterances), ("segments", manifest["segments"]),
                           ("tokens", manifest["tokens"]), ("bytes", size)):
            total[key] += value
    db["stores"].insert({"name": "general", "kind": "exact", "directory": "general", "speaker": None,
                         **total, "created_at": stamp, "params": json.dumps({"shards": n})}, pk="name")
    return directories


def _place_store(db, tmp: Path, name: str, source: Path, directory: Path, speaker: str, n_utts: int,
                 manifest: dict) -> None:
    _link_files(source, directory, manifest["files"])
    rows = _file_rows(tmp, name, directory, manifest["files"])
    db["files"].insert_all(rows, pk="path")
    stamp = catalog.now()
    db["stores"].insert({"name": name, "kind": "exact", "directory": directory.relative_to(tmp).as_posix(),
                         "speaker": speaker, "utterances": n_utts, "segments": manifest["segments"],
                         "tokens": manifest["tokens"], "bytes": sum(r["bytes"] for r in rows),
                         "created_at": stamp, "params": "{}"}, pk="name")
    db["speakers"].insert({"name": speaker, "store": name, "utterances": n_utts, "tokens": manifest["tokens"],
                           "enrolled_at": stamp}, pk="name")


def _link_files(source: Path, directory: Path, files: list[dict]) -> None:
    """Hard links: the work directory keeps its copy until the datastore is in place, at no cost in
    space or time (a copy where the filesystem has no hard links)."""
    directory.mkdir(parents=True, exist_ok=True)
    for row in files:
        try:
            os.link(source / row["name"], directory / row["name"])
        except OSError:
            shutil.copyfile(source / row["name"], directory / row["name"])


def _file_rows(root: Path, store: str, directory: Path, files: list[dict]) -> list[dict]:
    return [{"path": (directory / row["name"]).relative_to(root).as_posix(), "store": store,
             "bytes": row["bytes"], "sha256": row["sha256"]} for row in files]


def _partition_rows(work: Path, units: list[dict]):
    """The utterances' catalog rows, in corpus order, from the partition tasks' meta files."""
    for unit in units:
        directory = work / "parts" / f"unit-{unit['unit']:06d}"
        for name in sorted(n for n in unit["files"] if n.endswith(".meta.npz")):
            with np.load(directory / name, allow_pickle=False) as data:
                columns = [unpack_strings(data, key) for key in ("ids", "speakers", "sources", "extras")]
                tokens = data["tokens"].tolist()
            for uid, speaker, n, source, extra in zip(columns[0], columns[1], tokens, columns[2], columns[3]):
                yield uid, speaker or None, n, source, extra or None


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
        new = collect(read_corpus(corpus, vocab))
        segments = [s for u in new for s in split_segments(u.tokens)]
        if not segments:
            raise CorpusError(f"{_corpus_name(corpus)}: corpus is empty (no speech tokens)")
        segments, _ = split_layout_breaks(segments, ds.vocab_size, ds.codebooks)
        old_dir = ds._speaker_dirs.get(speaker)
        old_rows = ds.catalog_speaker(speaker)
        if old_dir is not None and not replace:
            segments = ds.speaker_store(speaker).segments() + segments
        n_utts = len(new) + (old_rows["utterances"] if old_rows and not replace else 0)
        final = root / "speakers" / speaker_dir(speaker)
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
            _insert_utterances(db, ((u.id, speaker, int((u.tokens >= 0).sum()), u.where,
                                     json.dumps(u.extra, default=str) if u.extra else None) for u in new))
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
        self.meta, self._stores, self._speakers, self._shards, self._files = (
            contents.meta, contents.stores, contents.speakers, contents.shards, contents.files)
        self.vocab_size = int(self.meta["vocab_size"])
        self.speech_offset = int(self.meta["speech_offset"])
        self.stop_ids = tuple(self.meta["stop_ids"])
        self.drop_ids = tuple(self.meta.get("drop_ids", ()))
        self.codebooks = int(self.meta.get("codebooks", 1))  # stores built before codebooks existed have one
        self.n_min, self.n_max = int(self.meta["n_min"]), int(self.meta["n_max"])
        self.sort_depth = int(self.meta["sort_depth"])
        self._speaker_dirs = {name: root / self._stores[row["store"]]["directory"]
                              for name, row in self._speakers.items()}
        directories = [row["directory"] for row in self._shards] or [self._stores["general"]["directory"]]
        self.shards = tuple(ExactStore(root / d, self.vocab_size) for d in directories)
        """The general store: its shards, each an exact store (most datastores have one)."""
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
            "shards": [{k: row[k] for k in ("shard", "directory", "utterances", "tokens", "bytes", "sha256")}
                       for row in self._shards],
            "files": self._files,
            "build": meta.get("build", {}),
            "build_seconds": meta.get("build_seconds"),
            "build_phases": meta.get("build_phases", {}),
            "build_tasks": meta.get("build_tasks", []),
            "created_at": meta["created_at"], "updated_at": meta["updated_at"],
        }

    def __repr__(self) -> str:
        return (f"Datastore({str(self.root)!r}, tokens={self._stores['general']['tokens']}, "
                f"shards={len(self.shards)}, speakers={len(self._speakers)}, faiss={self.has_faiss})")


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


def _corpus_name(corpus) -> str:
    return str(corpus) if isinstance(corpus, (str, Path)) else ", ".join(map(str, corpus))


def _meta(vocab: Vocabulary, codebooks, n_min, n_max, per_speaker, faiss, corpus, shards) -> dict:
    return {"vocab_size": vocab.size, "speech_offset": vocab.speech_offset, "stop_ids": list(vocab.stop_ids),
            "drop_ids": list(vocab.drop_ids), "codebooks": int(codebooks),
            "dtype": stream_dtype(vocab.size).name, "n_min": int(n_min), "n_max": int(n_max),
            "sort_depth": int(n_max),
            "build": {"corpus": _corpus_name(corpus), "per_speaker": per_speaker, "faiss": bool(faiss),
                      "shards": shards}}


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


def _insert_utterances(db, rows) -> Counter:
    """Insert (id, speaker, tokens, source, extra JSON) rows; returns utterances per speaker."""
    per_speaker: Counter = Counter()

    def counted():
        for row in rows:
            per_speaker[row[1]] += 1
            yield row

    # Plain executemany: sqlite-utils' per-row type handling cost 2 s for a 10M-token corpus.
    with db.atomic():
        db.conn.executemany("INSERT INTO utterances (id, speaker, tokens, source, extra) VALUES (?, ?, ?, ?, ?)",
                            counted())
    return per_speaker


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
