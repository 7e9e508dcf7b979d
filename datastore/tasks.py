"""The tasks of a build. Each runs in this process, in a local worker process or on a Ray worker: it takes
and returns plain data (paths, numbers, dicts) and hands its output on through files in the build's work
directory, which must therefore be visible to every worker (one machine's disk, or a shared filesystem).

  partition_unit   read one corpus unit (a file, or a Parquet row group); write its utterances' segments to
                   one file per shard (chosen by a stable hash of the utterance id: an utterance is never
                   split) and one per speaker group (a hash of the speaker), and their catalog rows.
                   Utterances with no speech tokens are counted and left out (the driver warns once).
  build_shard      one shard of the general store from its partition files, with the single-store builder;
                   a repeated utterance id is refused here, where every copy of an id lands (same hash)
  build_speakers   the speaker stores of one speaker group

Work directory (`.STORE.work-<key>` beside the datastore; the key digests the corpus files' names, sizes
and mtimes and the build options, so a changed corpus never reuses old work):
  parts/unit-000012/chunk-0000.shard-00003.npz   unit 12's segments for shard 3 (tokens, lengths, and the
                                                 ids the corpus gave with their places, for the id check)
  parts/unit-000012/chunk-0000.group-00001.npz   its segments for speaker group 1 (+ whose they are)
  parts/unit-000012/chunk-0000.meta.npz          its utterances' catalog rows, in corpus order
  parts/unit-000012/done.json                    the unit's counts and files
  shards/shard-00003/{tokens,sa,first}.npy, manifest.json (each file's size and sha256)
  speakers/group-00001/<speaker>-<tag>/{tokens,sa,first}.npy, manifest.json
Each task writes under a temporary name and renames its directory when complete, so a task killed midway
leaves nothing a re-run could take for finished; a re-run reuses finished units and verified shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path

import numpy as np
from numba import njit

from .catalog import sha256
from .corpus import UniqueIds, Vocabulary, read_batches, split_layout_breaks
from .errors import DatastoreError, one_line
from .exact import FILES, concat_segments, join_segments, write_exact_stream
from .files import atomic_dir, proc_bytes
from .partition import CHUNK_TOKENS, PartitionWriter, stable_hash, unpack_strings  # noqa: F401 (the build's names)

MANIFEST = "manifest.json"


def speaker_dir(name: str) -> str:
    """A file-system-safe, unique, fresh directory name for a speaker's store."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:40].strip(".") or "speaker"
    tag = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{slug}-{tag}-{uuid.uuid4().hex[:8]}"


# --- partition ---------------------------------------------------------------------------------------------


def partition_unit(work: str, index: int, unit: tuple[str, int], vocab: dict, shards: int, groups: int,
                   per_speaker: bool) -> dict:
    """Split one corpus unit into per-shard and per-speaker-group files; returns the unit's counts."""
    final = Path(work) / "parts" / f"unit-{index:06d}"
    with atomic_dir(final, replace=False) as tmp:
        writer = PartitionWriter(tmp, shards, groups if per_speaker else 0)
        for batch in read_batches(unit, Vocabulary(**{k: tuple(v) if isinstance(v, list) else v
                                                      for k, v in vocab.items()})):
            writer.add(batch)
        stats = {"unit": index, **writer.close()}
        _write_json(tmp / "done.json", stats)
    return _read_json(final / "done.json")


def finished_unit(work: Path, index: int) -> dict | None:
    """A unit's counts if an earlier run partitioned it completely and its files are as written (size and
    sha256: a file damaged since, even at its size, has the unit partitioned again)."""
    directory = work / "parts" / f"unit-{index:06d}"
    stats = _read_json(directory / "done.json")
    try:
        files = [(directory / name, size, stats["sha256"][name]) for name, size in stats["files"].items()]
    except (TypeError, KeyError, AttributeError):  # no such unit, or one from before checksums
        return None
    return stats if all(_intact(*file) for file in files) else None


def _intact(path: Path, size: int, digest: str) -> bool:
    return _size(path) == size and sha256(path) == digest


def _load_segments(path: Path) -> dict:
    """A partition file's arrays: its segments' tokens one after another and their lengths, and what else
    it keeps (ids, speakers)."""
    try:  # the driver checked this file's sha256; damage since is one line, and the unit is read again
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except Exception as e:
        shutil.rmtree(path.parent, ignore_errors=True)
        raise DatastoreError(f"{path}: a build work file is damaged ({one_line(e)}); it was removed: run the "
                             "same build again") from None


def _stream(tokens: np.ndarray, lengths: np.ndarray, vocab_size: int, codebooks: int) -> tuple[np.ndarray, int]:
    """A store's stream of these segments, split at layout breaks when codebooks interleave; and the breaks."""
    if codebooks == 1:
        return join_segments(tokens, lengths, vocab_size), 0
    segments, breaks = split_layout_breaks(np.split(tokens, np.cumsum(lengths)[:-1]) if len(lengths) else [],
                                           vocab_size, codebooks)
    return concat_segments(segments, vocab_size), breaks


# --- shards and speaker groups -----------------------------------------------------------------------------


def build_shard(work: str, shard: int, files: list[str], vocab_size: int, depth: int, codebooks: int) -> dict:
    """Shard `shard` of the general store from its partition files (in corpus order)."""
    started = time.perf_counter()
    final = Path(work) / "shards" / f"shard-{shard:05d}"
    with atomic_dir(final, replace=False) as tmp:
        _write_json(tmp / "task.json", _whoami())  # which worker builds it, for whoever watches
        tokens, lengths, ids = [], [], UniqueIds()
        for name in files:
            arrays = _load_segments(Path(name))
            tokens.append(arrays["tokens"])
            lengths.append(arrays["lengths"])
            for utt_id, where in zip(unpack_strings(arrays, "ids"), unpack_strings(arrays, "wheres")):
                ids.add(utt_id, where)
        del ids
        stream, breaks = _stream(_joined(tokens, np.uint16), _joined(lengths, np.int64), vocab_size, codebooks)
        del tokens, lengths
        counts = write_exact_stream(tmp, stream, vocab_size, depth)
        del stream
        manifest = {"shard": shard, **counts, "layout_breaks": breaks, "files": _checksums(tmp, FILES), **_whoami(),
                    "peak_rss_bytes": peak_rss(), "seconds": round(time.perf_counter() - started, 3)}
        _write_json(tmp / MANIFEST, manifest)
    return _read_json(final / MANIFEST)


def build_speakers(work: str, group: int, files: list[str], vocab_size: int, depth: int, codebooks: int) -> dict:
    """The speaker stores of speaker group `group`, each from its segments in corpus order."""
    started = time.perf_counter()
    final = Path(work) / "speakers" / f"group-{group:05d}"
    with atomic_dir(final, replace=False) as tmp:
        _write_json(tmp / "task.json", _whoami())
        tokens, lengths, owners, numbers = [], [], [], {}
        for name in files:
            arrays = _load_segments(Path(name))
            names = unpack_strings(arrays, "names")
            tokens.append(arrays["tokens"])
            lengths.append(arrays["lengths"])
            owners.append(np.array([numbers.setdefault(n, len(numbers)) for n in names], np.int64)[arrays["owner"]]
                          if len(names) else np.zeros(0, np.int64))
        tokens, lengths, owners = _joined(tokens, np.uint16), _joined(lengths, np.int64), _joined(owners, np.int64)
        order = np.argsort(owners, kind="stable")  # the segments by speaker, each speaker's in corpus order
        ends = np.cumsum(np.bincount(owners, minlength=len(numbers)))
        starts = np.cumsum(lengths) - lengths
        speakers = []
        for name in sorted(numbers):
            number, directory = numbers[name], speaker_dir(name)
            mine = order[ends[number - 1] if number else 0:ends[number]]
            stream, _ = _stream(_gather(tokens, starts[mine], lengths[mine]), lengths[mine], vocab_size, codebooks)
            counts = write_exact_stream(tmp / directory, stream, vocab_size, depth)
            speakers.append({"name": name, "directory": directory, **counts,
                             "files": _checksums(tmp / directory, FILES)})
        manifest = {"group": group, "speakers": speakers, **_whoami(), "peak_rss_bytes": peak_rss(),
                    "seconds": round(time.perf_counter() - started, 3)}
        _write_json(tmp / MANIFEST, manifest)
    return _read_json(final / MANIFEST)


def _joined(arrays: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype)


@njit(cache=True, nogil=True)
def _gather(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The segments tokens[starts[k]:starts[k] + lengths[k]], one after another: a copy per segment (a NumPy
    gather built two int64 index arrays as long as the output, 3 s of a 200M-token speaker task's 19)."""
    out = np.empty(lengths.sum(), tokens.dtype)
    j = 0
    for k in range(starts.shape[0]):
        n = lengths[k]
        out[j:j + n] = tokens[starts[k]:starts[k] + n]
        j += n
    return out


def finished_store(directory: Path) -> dict | None:
    """The manifest of a shard or speaker group an earlier run finished, if every file it lists still has
    its size and sha256; else None (it is then built again)."""
    manifest = _read_json(directory / MANIFEST)
    try:
        stores = [(directory / s["directory"], s["files"]) for s in manifest["speakers"]] \
            if "speakers" in manifest else [(directory, manifest["files"])]
        files = [(where / row["name"], row["bytes"], row["sha256"]) for where, rows in stores for row in rows]
    except (TypeError, KeyError, AttributeError):
        return None
    return manifest if all(_intact(*file) for file in files) else None


def _checksums(directory: Path, names) -> list[dict]:
    return [{"name": name, "bytes": (directory / name).stat().st_size, "sha256": sha256(directory / name)}
            for name in names]


# --- files -------------------------------------------------------------------------------------------------


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _whoami() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def peak_rss() -> int:
    """This process's peak resident set so far, in bytes: VmHWM where Linux's /proc has it, because ru_maxrss
    keeps the high-water mark of the process that forked this one across exec (a worker spawned by a
    driver holding 10 GB reported 10 GB), else ru_maxrss."""
    hwm = proc_bytes("/proc/self/status", "VmHWM")
    if hwm is not None:
        return hwm
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # macOS reports bytes, the others KiB
