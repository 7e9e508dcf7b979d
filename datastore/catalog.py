"""The catalog: one SQLite database per datastore (`catalog.sqlite`), kept with sqlite-utils.

Tables
  meta        key -> JSON value: format_version, vocabulary (speech_offset, vocab_size, stop_ids,
              drop_ids, codebooks: the interleaved-codebook layout of the speech ids),
              n_min, n_max, sort_depth, dtype, build parameters, created_at, updated_at
  stores      one row per store: name ("general", "speaker:<name>", "faiss"), kind, directory,
              utterances, segments, tokens, bytes, created_at, params (JSON)
  shards      the general store's shards: store, shard (0..S-1), directory, utterances, segments, tokens,
              bytes, sha256 (of its files' names and checksums), created_at
  speakers    name, store, utterances, tokens, enrolled_at
  utterances  id, speaker, tokens, source ("file:line"), extra (JSON: the corpus line's other fields)
  files       path (relative to the datastore), store, bytes, sha256
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import sqlite_utils

from .errors import DatastoreError
from .files import recover_dir

FORMAT_VERSION = 1
CATALOG = "catalog.sqlite"
PARTIAL = "catalog.sqlite.partial"  # a build's catalog until every store is written


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def create(root: Path, meta: dict) -> sqlite_utils.Database:
    """A new catalog in a build's temporary directory, named PARTIAL until `finish`: a directory
    left by an interrupted build has no catalog and so is no datastore. Insert the utterance rows in
    bulk, in one transaction (executemany), then `index_utterances`."""
    db = partial(root)
    db["meta"].create({"key": str, "value": str}, pk="key")
    db["stores"].create({"name": str, "kind": str, "directory": str, "speaker": str, "utterances": int,
                         "segments": int, "tokens": int, "bytes": int, "created_at": str, "params": str},
                        pk="name")
    db["shards"].create({"store": str, "shard": int, "directory": str, "utterances": int, "segments": int,
                         "tokens": int, "bytes": int, "sha256": str, "created_at": str}, pk=("store", "shard"))
    db["speakers"].create({"name": str, "store": str, "utterances": int, "tokens": int, "enrolled_at": str},
                          pk="name")
    db["utterances"].create({"id": str, "speaker": str, "tokens": int, "source": str, "extra": str})
    db["files"].create({"path": str, "store": str, "bytes": int, "sha256": str}, pk="path")
    set_meta(db, {"format_version": FORMAT_VERSION, "created_at": now(), "updated_at": now(), **meta})
    return db


def partial(root: Path) -> sqlite_utils.Database:
    """The catalog a build is writing in `root` (PARTIAL until `finish`; `create` makes it, and the build opens it
    again after a process of its own wrote its rows, rows.py). No per-commit syncs: the build syncs the whole
    directory once before renaming it into place."""
    db = sqlite_utils.Database(root / PARTIAL)
    db.conn.execute("PRAGMA synchronous=OFF")
    return db


def index_utterances(db: sqlite_utils.Database) -> None:
    """Index the utterance rows once they are all in: one sort instead of a b-tree insert per row (a build's bulk
    insert of 2.24M utterance rows took 0.54-0.68x the time without the index, measured side by side)."""
    db["utterances"].create_index(["speaker"], if_not_exists=True)


def finish(db: sqlite_utils.Database, root: Path) -> None:
    db.conn.close()
    (root / PARTIAL).rename(root / CATALOG)


def set_meta(db: sqlite_utils.Database, values: dict) -> None:
    db["meta"].upsert_all([{"key": k, "value": json.dumps(v)} for k, v in values.items()], pk="key")


TABLES = ("meta", "stores", "speakers", "utterances", "files")
META_INTS = {"vocab_size": (1, 2**32 - 2), "speech_offset": (0, 2**63 - 1), "n_min": (1, 64), "n_max": (1, 64),
             "sort_depth": (1, 64)}
"""Meta values a reader relies on, with the range a build writes; the other required keys follow."""
META_REQUIRED = ("format_version", *META_INTS, "stop_ids", "dtype", "created_at", "updated_at")
STORE_FILES = {"exact": ("tokens.npy", "sa.npy", "first.npy"), "faiss": ("index.faiss", "embeddings.npy")}
"""The files each kind of store has; verify checks the catalog lists (and so checksums) every one."""
EXTRA_FILES = {"exact": ("index.npy",), "faiss": ()}
"""Files a store has when it was built by a version that writes them (a store without them still reads)."""


@dataclass
class Contents:
    """What a reader needs from the catalog, checked: every row a Datastore indexes is there and sane."""

    meta: dict
    stores: dict[str, dict]  # name -> row, params already decoded
    speakers: dict[str, dict]
    shards: list[dict]  # the general store's shards in order; empty for a catalog older than shards
    files: list[dict]


def open_catalog(root: Path) -> sqlite_utils.Database:
    """The catalog of `root`, checked for its tables and format version."""
    path = root / CATALOG
    if not root.is_dir():
        recover_dir(root)  # a replace killed between its renames, where the exchange is not available
    if not root.is_dir():
        raise DatastoreError(f"{root}: no such datastore directory")
    if not path.is_file():
        raise DatastoreError(f"{root}: not a datastore (no {CATALOG}; an interrupted build leaves none)")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=rw", uri=True)
        db = sqlite_utils.Database(conn)
        tables = set(db.table_names())
    except sqlite3.DatabaseError as e:
        raise DatastoreError(f"{path}: unreadable catalog ({e})") from None
    if "meta" not in tables:
        db.conn.close()
        raise DatastoreError(f"{path}: not an echospec catalog (no meta table)")
    try:
        try:
            version = read_meta(db, path).get("format_version")
        except sqlite3.DatabaseError as e:
            raise DatastoreError(f"{path}: unreadable catalog ({e})") from None
        if version != FORMAT_VERSION:
            raise DatastoreError(f"{path}: unknown datastore format version {version!r}; "
                                 f"this echospec reads version {FORMAT_VERSION} (rebuild the datastore)")
        missing = [t for t in TABLES if t not in tables]
        if missing:
            raise DatastoreError(f"{path}: damaged catalog (no {missing[0]!r} table); rebuild the datastore")
    except BaseException:
        db.conn.close()
        raise
    return db


@contextmanager
def opened(root: Path):
    """The checked catalog of `root`, closed afterwards; SQLite's own errors (a corrupted file) become
    DatastoreError."""
    db = open_catalog(root)
    try:
        yield db
    except sqlite3.DatabaseError as e:
        raise DatastoreError(f"{root / CATALOG}: damaged catalog ({e}); rebuild the datastore") from None
    except KeyError as e:  # a row without a column every build writes
        raise DatastoreError(f"{root / CATALOG}: damaged catalog (no column {e})") from None
    finally:
        db.conn.close()


def read(root: Path, verify: bool = False) -> Contents:
    """Read and check the catalog, and check every file's size (with `verify`: everything `verify` checks)."""
    with opened(root) as db:
        path = root / CATALOG
        meta = read_meta(db, path)
        _check_meta(meta, path)
        stores = {row["name"]: row for row in db["stores"].rows}
        for row in stores.values():
            _check_store(row, path)
        if stores.get("general", {}).get("kind") != "exact":
            raise DatastoreError(f"{path}: damaged catalog (no 'general' exact store); rebuild the datastore")
        speakers = {row["name"]: row for row in db["speakers"].rows}
        for name, row in speakers.items():
            if stores.get(row["store"], {}).get("kind") != "exact":
                raise DatastoreError(f"{path}: damaged catalog (speaker {name!r} has no exact store)")
        shards = _read_shards(db, path, stores["general"]) if "shards" in db.table_names() else []
        files = check_files(db, root, verify)
        if verify:
            verify_catalog(db, root, stores, speakers, shards, files)
    return Contents(meta, stores, speakers, shards, files)


def _read_shards(db: sqlite_utils.Database, path: Path, general: dict) -> list[dict]:
    """The general store's shard rows, checked: numbered 0..S-1, as many as the store's params say, each
    directory inside the datastore."""
    shards = list(db["shards"].rows_where("store = 'general'", order_by="shard"))
    if [row["shard"] for row in shards] != list(range(len(shards))) \
            or general["params"].get("shards", len(shards)) != len(shards):
        raise DatastoreError(f"{path}: damaged catalog (the general store's shard rows are not numbered "
                             f"0..{general['params'].get('shards', len(shards)) - 1}); rebuild the datastore")
    for row in shards:
        if not inside(row["directory"]):
            raise DatastoreError(f"{path}: damaged catalog (shard {row['shard']} has directory "
                                 f"{row['directory']!r}, outside the datastore)")
        for key in ("utterances", "segments", "tokens", "bytes"):
            if type(row[key]) is not int or row[key] < 0:
                raise DatastoreError(f"{path}: damaged catalog (shard {row['shard']} has {key} {row[key]!r})")
    return shards


def shard_digest(files: list[dict]) -> str:
    """A shard's checksum (the shards table's sha256): the sha256 of its files' names and checksums."""
    return hashlib.sha256("".join(f"{PurePosixPath(r['path']).name}:{r['sha256']}\n" for r in files)
                          .encode()).hexdigest()


def read_meta(db: sqlite_utils.Database, path: Path | None = None) -> dict:
    meta = {}
    for row in db["meta"].rows:
        try:
            meta[row["key"]] = json.loads(row["value"])
        except (TypeError, ValueError):
            raise DatastoreError(f"{path or db.conn}: damaged catalog (meta {row['key']!r} is not JSON); "
                                 "rebuild the datastore") from None
    return meta


def _check_meta(meta: dict, path: Path) -> None:
    missing = next((key for key in META_REQUIRED if key not in meta), None)
    if missing is not None:
        raise DatastoreError(f"{path}: damaged catalog (meta has no {missing!r}); rebuild the datastore")
    for key, (low, high) in META_INTS.items():
        value = meta[key]
        if type(value) is not int or not low <= value <= high:
            raise DatastoreError(f"{path}: damaged catalog (meta {key!r} is {value!r}, not an integer in "
                                 f"{low}..{high}); rebuild the datastore")
    if not meta["n_min"] <= meta["n_max"] or not all(type(s) is int for s in _as_list(meta["stop_ids"])):
        raise DatastoreError(f"{path}: damaged catalog (n_min, n_max or stop_ids are inconsistent)")


def _as_list(value) -> list:
    return value if isinstance(value, list) else [None]


def _check_store(row: dict, path: Path) -> None:
    """A store row a reader can follow: a known kind, a directory inside the datastore, JSON params."""
    name = row["name"]
    if row["kind"] not in STORE_FILES:
        raise DatastoreError(f"{path}: damaged catalog (store {name!r} has unknown kind {row['kind']!r})")
    if not inside(row["directory"]):
        raise DatastoreError(f"{path}: damaged catalog (store {name!r} has directory {row['directory']!r}, "
                             "outside the datastore)")
    try:
        params = json.loads(row["params"] or "{}")
    except (TypeError, ValueError):
        params = None
    if not isinstance(params, dict):
        raise DatastoreError(f"{path}: damaged catalog (store {name!r} has params that are not a JSON object)")
    row["params"] = params
    for key in ("utterances", "segments", "tokens", "bytes"):
        if type(row[key]) is not int or row[key] < 0:
            raise DatastoreError(f"{path}: damaged catalog (store {name!r} has {key} {row[key]!r})")


def inside(relative) -> bool:
    """Whether a path the catalog records names something inside the datastore (relative, no '..')."""
    if not isinstance(relative, str) or "\\" in relative or "\0" in relative:
        return False
    path = PurePosixPath(relative)
    return bool(path.parts) and not path.is_absolute() and ".." not in path.parts


def verify_catalog(db: sqlite_utils.Database, root: Path, stores: dict, speakers: dict, shards: list[dict],
                   files: list[dict]) -> None:
    """What `--verify` adds to the file checksums: SQLite's own integrity check, every store file (every
    shard's) listed (so checksummed), each shard's checksum and the shards' sum matching the general
    store's rows, and each speaker's utterance count matching its utterance rows."""
    path = root / CATALOG
    problems = [row[0] for row in db.execute("PRAGMA integrity_check").fetchall()]
    if problems != ["ok"]:
        raise DatastoreError(f"{path}: SQLite integrity check failed ({problems[0]}); rebuild the datastore")
    listed = {row["path"]: row for row in files}
    directories = {name: [row["directory"]] for name, row in stores.items()}
    if shards:
        directories["general"] = [shard["directory"] for shard in shards]
    for name, row in sorted(stores.items()):
        for directory in directories[name]:
            for file in STORE_FILES[row["kind"]]:
                if f"{directory}/{file}" not in listed:
                    raise DatastoreError(f"{path}: the catalog lists no {directory}/{file} (store {name!r}), "
                                         "so it cannot be verified; rebuild the datastore")
    for shard in shards:
        rows = [listed[path] for file in STORE_FILES["exact"] + EXTRA_FILES["exact"]
                if (path := f"{shard['directory']}/{file}") in listed]
        if shard_digest(rows) != shard["sha256"]:
            raise DatastoreError(f"{path}: shard {shard['shard']}'s checksum does not match its files' rows; "
                                 "the catalog is inconsistent")
    if shards and sum(s["tokens"] for s in shards) != stores["general"]["tokens"]:
        raise DatastoreError(f"{path}: the shards hold {sum(s['tokens'] for s in shards)} tokens, the general "
                             f"store {stores['general']['tokens']}; the catalog is inconsistent")
    counts = dict(db.execute("SELECT speaker, count(*) FROM utterances GROUP BY speaker").fetchall())
    for name, row in sorted(speakers.items()):
        if counts.get(name, 0) != row["utterances"]:
            raise DatastoreError(f"{path}: speaker {name!r} has {row['utterances']} utterances, "
                                 f"the utterances table {counts.get(name, 0)}; the catalog is inconsistent")


def speaker_utterances(db: sqlite_utils.Database, speaker: str) -> list[tuple[str, int]]:
    """(id, speech tokens) of the utterance rows filed under `speaker`, in the order they were written."""
    return db.execute("SELECT id, tokens FROM utterances WHERE speaker = ? ORDER BY rowid", [speaker]).fetchall()


def record_files(db: sqlite_utils.Database, root: Path, store: str, directory: Path) -> int:
    """Checksum every file of a store's directory into `files`; returns their total bytes."""
    rows = []
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            rows.append({"path": path.relative_to(root).as_posix(), "store": store,
                         "bytes": path.stat().st_size, "sha256": sha256(path)})
    db["files"].delete_where("store = ?", [store])
    db["files"].insert_all(rows, pk="path", replace=True)
    return sum(r["bytes"] for r in rows)


def check_files(db: sqlite_utils.Database, root: Path, verify: bool) -> list[dict]:
    """Sizes always; sha256 too when `verify`. Raises DatastoreError naming the first bad file;
    returns the catalog's file rows."""
    rows = list(db["files"].rows)
    for row in rows:
        if not inside(row["path"]) or type(row["bytes"]) is not int:
            raise DatastoreError(f"{root / CATALOG}: damaged catalog (file row {row['path']!r})")
        path = root / row["path"]
        if not path.is_file():
            raise DatastoreError(f"{path}: missing (the catalog lists it)")
        size = path.stat().st_size
        if size != row["bytes"]:
            raise DatastoreError(f"{path}: {size} bytes, the catalog says {row['bytes']} (truncated or changed)")
        if verify and sha256(path) != row["sha256"]:
            raise DatastoreError(f"{path}: checksum mismatch (the file was changed or corrupted)")
    return rows


def record_store(db: sqlite_utils.Database, root: Path, name: str, directory: Path, speaker: str | None, n_utts: int,
                 counts: dict, kind: str = "exact", params: dict | None = None) -> None:
    """Record (or replace) one store written in `directory`: its files, its row, and its speaker's."""
    size = record_files(db, root, name, directory)
    stamp = now()
    db["stores"].upsert({"name": name, "kind": kind, "directory": directory.relative_to(root).as_posix(),
                         "speaker": speaker, "utterances": n_utts, "segments": counts["segments"],
                         "tokens": counts["tokens"], "bytes": size, "created_at": stamp,
                         "params": json.dumps(params or {})}, pk="name")
    if speaker is not None:
        db["speakers"].upsert({"name": speaker, "store": name, "utterances": n_utts, "tokens": counts["tokens"],
                               "enrolled_at": stamp}, pk="name")


def insert_utterances(db: sqlite_utils.Database, rows) -> Counter:
    """Insert (id, speaker, tokens, source, extra JSON) rows; returns utterances per speaker."""
    per_speaker: Counter = Counter()

    def counted():
        for row in rows:
            per_speaker[row[1]] += 1
            yield row

    with db.atomic():
        add_utterances(db, counted())
    return per_speaker


def add_utterances(db: sqlite_utils.Database, rows) -> None:
    """Insert (id, speaker, tokens, source, extra JSON) rows, in the caller's transaction. Plain executemany:
    sqlite-utils' per-row type handling cost 2 s for a 10M-token corpus."""
    db.conn.executemany("INSERT INTO utterances (id, speaker, tokens, source, extra) VALUES (?, ?, ?, ?, ?)", rows)


def add_shard(db: sqlite_utils.Database, files: list[dict], shard: dict) -> None:
    """A new build's shard: its files' rows and its own."""
    db["files"].insert_all(files, pk="path")
    db["shards"].insert(shard)


def add_stores(db: sqlite_utils.Database, stores: list[dict]) -> None:
    db["stores"].insert_all(stores, pk="name")


def add_speaker_stores(db: sqlite_utils.Database, files: list[dict], stores: list[dict], speakers: list[dict]) -> None:
    """A new build's speaker stores, each table's rows in one insert (sqlite-utils looks a table up on every
    call: one call per speaker cost ~10 ms)."""
    db["files"].insert_all(files, pk="path")
    add_stores(db, stores)
    db["speakers"].insert_all(speakers, pk="name")


def remove_utterances(db: sqlite_utils.Database, speaker: str) -> None:
    """Delete the utterance rows filed under `speaker` (an enrollment that replaces the speaker)."""
    db["utterances"].delete_where("speaker = ?", [speaker])


def speaker_store_directory(db: sqlite_utils.Database, speaker: str) -> str | None:
    """The directory (relative to the datastore) of the store the catalog names for `speaker`, or None."""
    row = db.execute("SELECT s.directory FROM speakers p JOIN stores s ON s.name = p.store WHERE p.name = ?",
                     [speaker]).fetchone()
    return None if row is None else row[0]


def corpus_name(corpus) -> str:
    """How the catalog's meta names a corpus (a path, or the paths of several)."""
    return str(corpus) if isinstance(corpus, (str, Path)) else ", ".join(map(str, corpus))
