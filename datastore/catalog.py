"""The catalog: one SQLite database per datastore (`catalog.sqlite`), kept with sqlite-utils.

Tables
  meta        key -> JSON value: format_version, vocabulary (speech_offset, vocab_size, stop_ids),
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
from pathlib import Path

import sqlite_utils

from .errors import DatastoreError

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
    left by an interrupted build has no catalog and so is no datastore. No per-commit syncs: the
    build syncs the whole directory once before renaming it into place."""
    db = sqlite_utils.Database(root / PARTIAL)
    db.conn.execute("PRAGMA synchronous=OFF")
    db["meta"].create({"key": str, "value": str}, pk="key")
    db["stores"].create({"name": str, "kind": str, "directory": str, "speaker": str, "utterances": int,
                         "segments": int, "tokens": int, "bytes": int, "created_at": str, "params": str},
                        pk="name")
    db["shards"].create({"store": str, "shard": int, "directory": str, "utterances": int, "segments": int,
                         "tokens": int, "bytes": int, "sha256": str, "created_at": str}, pk=("store", "shard"))
    db["speakers"].create({"name": str, "store": str, "utterances": int, "tokens": int, "enrolled_at": str},
                          pk="name")
    db["utterances"].create({"id": str, "speaker": str, "tokens": int, "source": str, "extra": str})
    db["utterances"].create_index(["speaker"])
    db["files"].create({"path": str, "store": str, "bytes": int, "sha256": str}, pk="path")
    set_meta(db, {"format_version": FORMAT_VERSION, "created_at": now(), "updated_at": now(), **meta})
    return db


def finish(db: sqlite_utils.Database, root: Path) -> None:
    db.conn.close()
    (root / PARTIAL).rename(root / CATALOG)


def set_meta(db: sqlite_utils.Database, values: dict) -> None:
    db["meta"].upsert_all([{"key": k, "value": json.dumps(v)} for k, v in values.items()], pk="key")


def open_catalog(root: Path) -> sqlite_utils.Database:
    path = root / CATALOG
    if not root.is_dir():
        raise DatastoreError(f"{root}: no such datastore directory")
    if not path.is_file():
        raise DatastoreError(f"{root}: not a datastore (no {CATALOG}; an interrupted build leaves none)")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=rw", uri=True)
        db = sqlite_utils.Database(conn)
        meta = read_meta(db)
    except sqlite3.DatabaseError as e:
        raise DatastoreError(f"{path}: unreadable catalog ({e})") from None
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise DatastoreError(f"{path}: unknown datastore format version {version!r}; "
                             f"this echospec reads version {FORMAT_VERSION} (rebuild the datastore)")
    return db


def read_meta(db: sqlite_utils.Database) -> dict:
    if "meta" not in db.table_names():
        raise DatastoreError(f"{db.conn} is not an echospec catalog (no meta table)")
    return {row["key"]: json.loads(row["value"]) for row in db["meta"].rows}


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
        path = root / row["path"]
        if not path.is_file():
            raise DatastoreError(f"{path}: missing (the catalog lists it)")
        size = path.stat().st_size
        if size != row["bytes"]:
            raise DatastoreError(f"{path}: {size} bytes, the catalog says {row['bytes']} (truncated or changed)")
        if verify and sha256(path) != row["sha256"]:
            raise DatastoreError(f"{path}: checksum mismatch (the file was changed or corrupted)")
    return rows
