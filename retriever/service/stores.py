"""The served datastores: one consistent `Snapshot` each, swapped whole after a write, and the polling
that picks up writes made by other processes."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...datastore import DamagedStoreError, DatastoreError, Enrollment, EnrollmentConflict, enroll, open_datastore
from ...datastore.catalog import CATALOG
from ...datastore.names import check_name
from ..retriever import Retriever
from .requests import ServiceError

log = logging.getLogger("echospec.service")


@dataclass(frozen=True)
class Snapshot:
    """One consistent view of a datastore: its retriever and what validation needs to know about it."""

    retriever: Retriever
    info: dict
    vocab_size: int
    speakers: frozenset[str]
    speech_offset: int
    stop_ids: frozenset[int]
    catalog_stamp: tuple[int, int]  # the catalog's (mtime_ns, size) just before it was read

    @classmethod
    def open(cls, path: Path, retriever_options: dict, access: str = "auto") -> "Snapshot":
        try:
            stamp = catalog_stamp(path)  # taken first: a write racing with this open shows up as a change later
        except FileNotFoundError:
            open_datastore(path)  # raises DatastoreError with the reason (no directory, interrupted build)
            raise
        ds = open_datastore(path, access=access)
        # Map every speaker store now: an enrollment deletes a replaced store's directory once its
        # catalog commit is done, and this snapshot may still answer for that speaker until the swap.
        for speaker in ds.speakers:
            try:
                ds.speaker_store(speaker)
            except DatastoreError as e:  # that speaker's proposals are a 503 (mapping it fails again); not the rest
                log.error("%s: speaker %s's store is damaged; serving the others: %s", path, speaker, e)
        retriever = Retriever(ds, **retriever_options)  # which loads the compiled kernels before the first request
        return cls(retriever, _jsonable(ds.info()), int(retriever.vocab_size), frozenset(ds.speakers),
                   ds.speech_offset, frozenset(ds.stop_ids), stamp)


def catalog_stamp(path: Path) -> tuple[int, int]:
    stat = (path / CATALOG).stat()
    return stat.st_mtime_ns, stat.st_size


class StoreHandle:
    """A served datastore: its current snapshot (swapped whole) and a lock serialising its writes.

    A datastore found damaged when opened (a missing or truncated file, a bad header, a damaged catalog) is
    held without a snapshot: its requests are answered 503 `store_damaged` while the other stores answer,
    until its catalog changes (a rebuild) and it opens. `strict` raises instead. A path that is no datastore
    at all (no directory, no catalog) is a mistake in the command, not damage: it always raises."""

    def __init__(self, name: str, path: Path, retriever_options: dict, strict: bool = False, access: str = "auto"):
        self.name, self.path, self.retriever_options, self.access = name, path, retriever_options, access
        self.write_lock = threading.Lock()  # held by the worker thread, so a dropped client cannot free it
        self.damage: str | None = None  # why the datastore could not be opened
        self.damage_stamp: tuple[int, int] | None = None  # its catalog's stamp then
        try:
            self.snapshot: Snapshot | None = Snapshot.open(path, retriever_options, access)
        except DatastoreError as e:
            if strict or not (path / CATALOG).is_file():
                raise
            self.snapshot, self.damage, self.damage_stamp = None, str(e), _stamp_or_none(path)

    def current(self) -> Snapshot:
        """The snapshot to answer from; a 503 for a datastore that could not be opened."""
        snapshot = self.snapshot
        if snapshot is None:
            raise ServiceError(503, "store_damaged", f"store {self.name!r} is damaged: {self.damage}")
        return snapshot

    def enroll(self, speaker: str, utterances: list[dict], replace: bool) -> tuple[Snapshot, Enrollment]:
        """Write, commit, reopen, swap: returns the new snapshot once it is the one being served, and what
        the enrollment did (utterances the speaker already had are left as they are)."""
        with self.write_lock:
            try:
                done = enroll(self.path, speaker, utterances, replace=replace)
            except EnrollmentConflict as e:
                raise ServiceError(409, "utterance_conflict", str(e)) from None
            except DamagedStoreError as e:  # appending needs the old store's data: replacing the speaker does not
                raise ServiceError(503, "store_damaged", str(e)) from None
            except DatastoreError as e:  # CorpusError included; the service's checks make this rare
                raise ServiceError(422, "enroll_rejected", str(e)) from None
            if done.added or replace:
                self.snapshot = Snapshot.open(self.path, self.retriever_options, self.access)
            return self.snapshot, done

    def reload_if_changed(self) -> bool:
        """Swap in a fresh snapshot when another process (`echospec enroll`, a second service, a rebuild)
        changed the catalog. Returns whether it did."""
        with self.write_lock:
            seen = self.snapshot.catalog_stamp if self.snapshot is not None else self.damage_stamp
            if _stamp_or_none(self.path) == seen:
                return False
            try:
                self.snapshot = Snapshot.open(self.path, self.retriever_options, self.access)
            except DatastoreError as e:
                if self.snapshot is None:  # still damaged: tried again when the catalog changes next
                    self.damage, self.damage_stamp = str(e), _stamp_or_none(self.path)
                raise
            self.damage = self.damage_stamp = None
            return True

    def describe(self) -> dict:
        """The store as GET /v1/stores/{store} shows it."""
        info = self.current().info
        keep = ("vocabulary", "n_min", "n_max", "utterances", "tokens", "speakers", "exact_bytes", "faiss_bytes",
                "created_at", "updated_at")
        return {"name": self.name, **{k: info[k] for k in keep if k in info}}


def _stamp_or_none(path: Path) -> tuple[int, int] | None:
    try:
        return catalog_stamp(path)
    except OSError:
        return None


def parse_store_arg(arg: str) -> tuple[str, Path]:
    """`NAME=PATH` or `PATH` (the name is then the directory's name)."""
    name, sep, path = arg.partition("=")
    if not sep:
        name, path = Path(arg).resolve().name, arg
    try:
        check_name("store", name)
    except DatastoreError as e:
        raise ValueError(f"{e} (give NAME=PATH to choose one)") from None
    return name, Path(path)


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
