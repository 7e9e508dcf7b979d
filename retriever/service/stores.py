"""The served datastores: one consistent `Snapshot` each, swapped whole after a write, and the polling
that picks up writes made by other processes."""

from __future__ import annotations

import json
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...datastore import DatastoreError, enroll, open_datastore
from ...datastore.catalog import CATALOG
from ...datastore.names import check_name
from ..retriever import Retriever
from .requests import ServiceError


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
    def open(cls, path: Path, retriever_options: dict) -> "Snapshot":
        try:
            stamp = catalog_stamp(path)  # taken first: a write racing with this open shows up as a change later
        except FileNotFoundError:
            open_datastore(path)  # raises DatastoreError with the reason (no directory, interrupted build)
            raise
        ds = open_datastore(path)
        # Map every speaker store now: an enrollment deletes a replaced store's directory once its
        # catalog commit is done, and this snapshot may still answer for that speaker until the swap.
        for speaker in ds.speakers:
            ds.speaker_store(speaker)
        retriever = Retriever(ds, **retriever_options)
        retriever.propose(np.zeros(1, np.int64))  # compile/load the kernels before the first request
        return cls(retriever, _jsonable(ds.info()), int(retriever.vocab_size), frozenset(ds.speakers),
                   ds.speech_offset, frozenset(ds.stop_ids), stamp)


def catalog_stamp(path: Path) -> tuple[int, int]:
    stat = (path / CATALOG).stat()
    return stat.st_mtime_ns, stat.st_size


class StoreHandle:
    """A served datastore: its current snapshot (swapped whole) and a lock serialising its writes."""

    def __init__(self, name: str, path: Path, retriever_options: dict):
        self.name, self.path, self.retriever_options = name, path, retriever_options
        self.snapshot = Snapshot.open(path, retriever_options)
        self.write_lock = threading.Lock()  # held by the worker thread, so a dropped client cannot free it

    def enroll(self, speaker: str, utterances: list[dict], replace: bool) -> Snapshot:
        """Write, commit, reopen, swap: returns the new snapshot once it is the one being served."""
        with self.write_lock, tempfile.TemporaryDirectory(prefix="echospec-enroll-") as tmp:
            corpus = Path(tmp) / "utterances.jsonl"
            with open(corpus, "w") as f:
                for utt in utterances:
                    f.write(json.dumps({"id": utt["id"], "speaker": speaker, "tokens": utt["tokens"]}) + "\n")
            try:
                enroll(self.path, speaker, corpus, replace=replace)
            except DatastoreError as e:  # CorpusError included; the checks below make this rare
                raise ServiceError(422, "enroll_rejected", str(e).replace(str(corpus), "request")) from None
            self.snapshot = snapshot = Snapshot.open(self.path, self.retriever_options)
            return snapshot

    def reload_if_changed(self) -> bool:
        """Swap in a fresh snapshot when another process (`echospec enroll`, a second service) changed
        the catalog. Returns whether it did."""
        with self.write_lock:
            if catalog_stamp(self.path) == self.snapshot.catalog_stamp:
                return False
            self.snapshot = Snapshot.open(self.path, self.retriever_options)
            return True

    def describe(self) -> dict:
        """The store as GET /v1/stores/{store} shows it."""
        info = self.snapshot.info
        keep = ("vocabulary", "n_min", "n_max", "utterances", "tokens", "speakers", "exact_bytes", "faiss_bytes",
                "created_at", "updated_at")
        return {"name": self.name, **{k: info[k] for k in keep if k in info}}


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
