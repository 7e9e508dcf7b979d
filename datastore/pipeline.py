"""The tasks of a build, in order: partition the corpus units (`partition`), then build every shard of the
general store and every speaker group (`build_stores`); finished work found in the work directory is reused
(see tasks.py).

Memory a task needs (measured by tools/benchmarks/bench_shards.py: 23 B per token, 4.6 GB for a 199M-token
store): the single-store builder's peak is the suffix array (4 B a token), key words 0 and 1 (2 x 8 B), the
stream (2 B, 4 with a vocabulary of 65,535 ids or more) and scratch for the largest bucket (~1% of the
tokens); the partition files it came from (2-4 B) are freed before the sort. SORT_BYTES_PER_TOKEN adds room
to that for the largest vocabularies. A partition task holds at most tasks.CHUNK_TOKENS tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .catalog import FORMAT_VERSION
from .corpus import Vocabulary, corpus_units, warn_dropped, warn_skipped
from .errors import CorpusError, DatastoreError
from .exact import MAX_TOKENS
from .runners import LocalRunner, RayRunner
from .tasks import CHUNK_TOKENS, build_shard, build_speakers, finished_store, finished_unit, partition_unit

SORT_BYTES_PER_TOKEN = 40
TASK_BASE_BYTES = 512 << 20
PARTITION_BYTES = TASK_BASE_BYTES + 40 * CHUNK_TOKENS


@dataclass
class Outcome:
    vocab: Vocabulary  # with its size known
    units: list[dict]  # partition_unit's counts, in corpus order
    shards: list[dict]  # build_shard's manifests, by shard
    groups: list[dict]  # build_speakers' manifests, by speaker group
    seconds: dict  # wall-clock seconds of each phase: reading the corpus, building the stores

    @property
    def layout_breaks(self) -> int:
        """Places where a segment was split for a token outside the codebook due (see corpus.split_layout_breaks)."""
        return sum(shard["layout_breaks"] for shard in self.shards)


def work_dir(target: Path, files: list[Path], options: dict) -> Path:
    """Where this build keeps finished work until it succeeds: named by the corpus files (resolved path,
    size, mtime) and the options, so only the very same build reuses it."""
    identity = {"format": FORMAT_VERSION, "chunk": CHUNK_TOKENS, "options": options,
                "files": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return target.parent / f".{target.name}.work-{key}"


def make_runner(ray: str | None, workers: int | None, shards: int):
    if ray is not None:
        return RayRunner(ray)
    return LocalRunner(workers if workers is not None else min(os.cpu_count() or 1, shards))


@dataclass
class Partitioned:
    vocab: Vocabulary  # with its size known
    units: list[dict]  # partition_unit's counts, in corpus order
    seconds: dict  # reading the corpus: wall and this process's CPU seconds

    @property
    def dropped(self) -> dict:
        """Ids left out for being outside the speech range (drop_non_speech): how many, from how many utterances."""
        return {key: sum(u.get(f"dropped_{key}", 0) for u in self.units) for key in ("tokens", "utterances")}


def partition(work: Path, files: list[Path], vocab: Vocabulary, codebooks: int, shards: int, per_speaker: bool,
              runner, progress: bool) -> Partitioned:
    """Read the corpus into the work directory's per-shard and per-speaker-group files (the first task)."""
    started, cpu = time.perf_counter(), time.process_time()
    units = _partition(work, files, vocab, shards, per_speaker, runner, progress)
    if sum(u["tokens"] for u in units) == 0:  # said alone: no warning about what was skipped first
        names = ", ".join(str(f) for f in files)
        raise CorpusError(f"{names}: corpus is empty (no speech tokens)")
    skipped = [u for u in units if u["skipped"]]
    if skipped:
        warn_skipped(skipped[0]["first_skipped"], sum(u["skipped"] for u in skipped))
    dropped = [u for u in units if u.get("dropped_tokens")]
    if dropped:
        warn_dropped(dropped[0]["first_dropped"], sum(u["dropped_tokens"] for u in dropped),
                     sum(u["dropped_utterances"] for u in dropped), vocab)
    if vocab.size is None:  # the largest id seen, rounded up to whole codebooks
        size = -(-(max(u["max_id"] for u in units) + 1) // codebooks) * codebooks
        vocab = dataclasses.replace(vocab, size=size)
    return Partitioned(vocab, units, {"read": round(time.perf_counter() - started, 3),
                                      "read_cpu": round(time.process_time() - cpu, 3)})


def build_stores(work: Path, parts: Partitioned, codebooks: int, shards: int, per_speaker: bool, depth: int, runner,
                 progress: bool) -> Outcome:
    """Build every shard and speaker group from the partition files (the tasks after `partition`)."""
    read, read_cpu = time.perf_counter(), time.process_time()
    vocab, units = parts.vocab, parts.units
    shard_tokens = [sum(u["shard_tokens"][i] for u in units) for i in range(shards)]
    _check_shard_sizes([t + sum(u["shard_segments"][i] for u in units) + 1 for i, t in enumerate(shard_tokens)],
                       shards)
    groups = shards if per_speaker else 0
    group_tokens = [sum(u["group_tokens"][j] for u in units) for j in range(groups)]
    store = {"work": str(work), "vocab_size": vocab.size, "depth": depth, "codebooks": codebooks}
    jobs = [(("shard", i), build_shard, {**store, "shard": i, "files": _files(work, units, f"shard-{i:05d}")},
             task_memory(shard_tokens[i])) for i in range(shards)]
    jobs += [(("group", j), build_speakers, {**store, "group": j, "files": _files(work, units, f"group-{j:05d}")},
              task_memory(group_tokens[j])) for j in range(groups)]
    done = _reuse(work, jobs)
    bar = tqdm(total=len(jobs), initial=len(done), desc=f"building {shards} shard{'s' * (shards > 1)}"
               + (f" + {groups} speaker group{'s' * (groups > 1)}" if groups else ""), unit=" task",
               disable=not progress)
    for key, manifest in runner.run([job for job in jobs if job[0] not in done]):
        done[key] = manifest
        bar.update()
    bar.close()
    # wall seconds of each phase, and this process's CPU seconds (all of a build's when it runs its tasks itself)
    seconds = {**parts.seconds, "stores": round(time.perf_counter() - read, 3),
               "stores_cpu": round(time.process_time() - read_cpu, 3)}
    return Outcome(vocab, units, [done[("shard", i)] for i in range(shards)],
                   [done[("group", j)] for j in range(groups)], seconds)


def task_memory(tokens: int) -> int:
    return TASK_BASE_BYTES + SORT_BYTES_PER_TOKEN * tokens


def _partition(work: Path, files, vocab: Vocabulary, shards: int, per_speaker: bool, runner,
               progress: bool) -> list[dict]:
    units = corpus_units(files)
    found = [finished_unit(work, i) for i in range(len(units))]
    for i in range(len(units)):  # a unit that does not verify is read again: its directory goes first
        if found[i] is None:
            shutil.rmtree(work / "parts" / f"unit-{i:06d}", ignore_errors=True)
    vocab_args = {"speech_offset": vocab.speech_offset, "size": vocab.size, "stop_ids": list(vocab.stop_ids),
                  "drop_ids": list(vocab.drop_ids), "drop_non_speech": vocab.drop_non_speech}
    jobs = [(i, partition_unit, {"work": str(work), "index": i, "unit": unit, "vocab": vocab_args, "shards": shards,
                 "groups": shards, "per_speaker": per_speaker}, PARTITION_BYTES)
            for i, unit in enumerate(units) if found[i] is None]
    bar = tqdm(total=len(units), initial=len(units) - len(jobs), desc="reading corpus", unit=" part",
               disable=not progress, leave=False)
    for index, stats in runner.partition(jobs):
        found[index] = stats
        bar.update()
    bar.close()
    return found


def _files(work: Path, units: list[dict], suffix: str) -> list[str]:
    """One shard's (or speaker group's) partition files, in corpus order."""
    return [str(work / "parts" / f"unit-{u['unit']:06d}" / name)
            for u in units for name in sorted(u["files"]) if name.endswith(f".{suffix}.npz")]


def _reuse(work: Path, jobs) -> dict:
    """Manifests of the shards and speaker groups an earlier run finished and whose files verify; the
    directories of those that do not verify are removed so that their tasks build them afresh."""
    done = {}
    for key, _, _, _ in jobs:
        directory = work / ("shards" if key[0] == "shard" else "speakers") / f"{key[0]}-{key[1]:05d}"
        manifest = finished_store(directory)
        if manifest is not None:
            done[key] = manifest
        elif directory.exists():
            shutil.rmtree(directory)
    return done


def _check_shard_sizes(streams: list[int], shards: int) -> None:
    """Each shard's stream (its tokens, a sentinel per segment and one more) must fit the int32 suffix
    array; the datastore as a whole may hold any number of tokens."""
    largest = max(range(shards), key=streams.__getitem__)
    if streams[largest] > MAX_TOKENS:
        need = -(-sum(streams) * 21 // (20 * MAX_TOKENS))  # 5% room: hashing balances shards only roughly
        raise DatastoreError(f"shard {largest} would hold {streams[largest]} tokens and separators, over the "
                             f"{MAX_TOKENS} one store can index (int32 suffix array): use --shards "
                             f"{max(need, shards + 1)} or more")
