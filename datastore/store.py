"""Open a datastore: a directory holding a general exact store, per-speaker exact stores, an optional FAISS
store and the SQLite catalog that describes them. Writing one is building.py's (`build`) and
enrollment.py's (`enroll`).

Layout
  STORE/catalog.sqlite               catalog (see catalog.py); written last, so no catalog = no store
  STORE/general/{tokens,sa,first}.npy                 the general store, when it is one shard
  STORE/general/shard-NNNNN/{tokens,sa,first}.npy     ... its shards, when there are several
  STORE/speakers/<slug>-<gen>/{tokens,sa,first}.npy   one directory per speaker, replaced whole on enroll
  STORE/faiss/{index.faiss,embeddings.npy}            optional (see faiss_store.py)

Every write goes to a temporary directory, is fsynced and renamed into place (files.atomic_dir), so a
build or enrollment killed at any instant leaves the old datastore or the new one.
"""

from __future__ import annotations

import threading
from pathlib import Path

from . import catalog
from .errors import DatastoreError
from .files import proc_bytes
from .exact import ExactStore

N_MIN = 1
"""Shortest context suffix an exact store matches: a one-token match still beats proposing nothing
(oracle acceptance 2.64 tokens/step at n_min 1, 1.91 at 2; see echospec.retriever.retriever)."""
N_MAX = 8
"""Longest context suffix an exact store sorts and matches to. On speech tokens, matches longer
than 4 rarely have the support the retriever asks for: n_max 4, 8 and 16 score within 0.01
tokens/step, and each extra key word (4 tokens of a 4,096-id vocabulary) costs the build's sort a radix
sort of the suffixes still tied after the words before it (a quarter of them after 4 tokens of speech)."""


ACCESS = ("auto", "random", "stream", "readahead")


def open_datastore(store_dir, verify: bool = False, access: str = "auto") -> Datastore:
    """Open a datastore: read and check the catalog (format version, the rows a reader follows) and
    every file's size, and memory-map the general store; speaker stores map on first use. `verify`
    adds SQLite's integrity check, every file's sha256 and the catalog's own consistency (catalog.read).
    `access`: how the stores read from disk, see choose_access."""
    return Datastore(Path(store_dir), verify, access)


def choose_access(access: str, stream_bytes: int, sa_bytes: int, available: int | None) -> str:
    """How the stores' maps read from disk: "readahead", "stream" or "random" ("auto" chooses).

    "readahead" leaves both to the kernel's read-around: a miss reads a stretch around it (8 MB on this
    project's VMs), so a store that fits is read in a few large reads and is then served warm. "random"
    advises stream and suffix array MADV_RANDOM: a miss reads 4 kB, so a store that does not fit is not read
    whole and evicted again. "stream" reads the stream (a third of the store) into memory when a store is
    opened and advises the suffix array random: a proposal's binary searches and its continuations read the
    stream at scattered places (from a cold cache on a 20M-token store, 18 and 15 of a proposal's 34 misses;
    the suffix array 1 with the sampled index), so a replica with RAM for the stream but not for the store
    takes 1.1 misses a proposal instead of 4.4 over 3,000 cold proposals, 16 instead of 49 at 200M tokens in
    16 shards (docs/scaling.md). Opening then reads the stream whole (as long as the disk takes to read it),
    so it is for serving (`echospec serve --access stream`), and "auto" never picks it: a one-off query would
    read it all.

    "auto" chooses "random" when the general store's stream and suffix array (`stream_bytes`, `sa_bytes`)
    take more than half of the memory `available` (MemAvailable when opened; random where it is unknown).
    Answers never depend on the choice."""
    if access not in ACCESS:
        raise ValueError(f"access must be one of {ACCESS}, got {access!r}")
    if access != "auto":
        return access
    fits = available is not None and stream_bytes + sa_bytes <= available // 2
    return "readahead" if fits else "random"


class Datastore:
    """An open datastore. Thread-safe for reads; stores are memory-mapped."""

    def __init__(self, root: Path, verify: bool = False, access: str = "auto"):
        self.root = root
        contents = catalog.read(root, verify)
        self.meta, self._stores, self._speakers, self._shards, self._files = (
            contents.meta, contents.stores, contents.speakers, contents.shards, contents.files)
        self.vocab_size = int(self.meta["vocab_size"])
        self.speech_offset = int(self.meta["speech_offset"])
        self.stop_ids = tuple(self.meta["stop_ids"])
        self.drop_ids = tuple(self.meta.get("drop_ids", ()))
        self.drop_non_speech = "dropped_non_speech" in self.meta.get("build", {})
        """Built with drop_non_speech: enrollment removes ids outside the speech range as the build did."""
        self.codebooks = int(self.meta.get("codebooks", 1))  # stores built before codebooks existed have one
        self.n_min, self.n_max = int(self.meta["n_min"]), int(self.meta["n_max"])
        self.sort_depth = int(self.meta["sort_depth"])
        self._speaker_dirs = {name: root / self._stores[row["store"]]["directory"]
                              for name, row in self._speakers.items()}
        directories = [row["directory"] for row in self._shards] or [self._stores["general"]["directory"]]
        sizes = {row["path"]: row["bytes"] for row in self._files}  # checked against the files by catalog.read
        self.stream_bytes, self.sa_bytes = (sum(sizes.get(f"{d}/{name}", 0) for d in directories)
                                            for name in ("tokens.npy", "sa.npy"))
        """The general store's streams and suffix arrays, in bytes: what serving it maps (see choose_access)."""
        self.access = choose_access(access, self.stream_bytes, self.sa_bytes,
                                    proc_bytes("/proc/meminfo", "MemAvailable"))
        """How the stores read from disk: "readahead", "stream" or "random" (see choose_access)."""
        self.shards = tuple(ExactStore(root / d, self.vocab_size, self.access) for d in directories)
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
            return ExactStore(self._speaker_dirs[speaker], self.vocab_size, self.access)
        except DatastoreError:
            with catalog.opened(self.root) as db:
                directory = catalog.speaker_store_directory(db, speaker)
            if directory is None or not catalog.inside(directory):
                raise
            return ExactStore(self.root / directory, self.vocab_size, self.access)

    def faiss_store(self):
        """The FAISS store, or None when the datastore was built without one."""
        if self._faiss is None and self.has_faiss:
            with self._lock:
                if self._faiss is None:
                    from .faiss_store import open_faiss_store
                    row = self._stores["faiss"]
                    self._faiss = open_faiss_store(self.root / row["directory"], row["params"], self.vocab_size)
        return self._faiss

    def speaker_directory(self, speaker: str) -> Path | None:
        """Where the speaker's store is, as this datastore was opened; None for an unknown speaker."""
        return self._speaker_dirs.get(speaker)

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
            "serving": {"stream_bytes": self.stream_bytes, "sa_bytes": self.sa_bytes, "access": self.access},
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
