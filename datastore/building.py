"""Build a datastore: run the build's tasks (pipeline.py, tasks.py) and assemble what they made, the shards and
speaker stores linked in, the catalog and the FAISS store, into a temporary directory that replaces the
target in one step (files.atomic_dir). A build killed at any instant leaves the old datastore or the new one,
and its finished tasks' work beside the target for the next run of the same build to reuse.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from . import catalog, pipeline
from .corpus import Vocabulary, corpus_files
from .errors import CorpusError, DatastoreError
from .exact import stream_dtype
from .files import atomic_dir, recover_dir, remove_abandoned
from .store import N_MAX, N_MIN, Datastore, open_datastore


def build(corpus, store_dir, per_speaker: bool = True, faiss: bool = True, embeddings=None,
          speech_offset: int = 0, vocab_size: int | None = None, stop_ids: Iterable[int] = (),
          drop_ids: Iterable[int] = (), codebooks: int = 1, n_min: int = N_MIN, n_max: int = N_MAX,
          force: bool = False, progress: bool = True, faiss_options: dict | None = None, shards: int = 1,
          ray: str | None = None, workers: int | None = None, drop_non_speech: bool = False) -> Datastore:
    """Build a datastore from a corpus: files or glob patterns (JSONL, JSONL manifest of .npy, .npz,
    Parquet; see corpus.py).

    `speech_offset`, `vocab_size` and `stop_ids` map raw model ids to store-local speech ids
    (local = raw - speech_offset, 0 <= local < vocab_size; stop ids end a segment and are never
    stored); `drop_ids` are marker ids removed wherever they occur. An id outside the speech range that is
    no stop id is refused, naming its file and line, unless `drop_non_speech`: then it is removed (a corpus
    dumped from training sequences that hold text, global or time tokens besides the speech ones), the
    build warns once with how many and where the first is, and `info()["build"]["dropped_non_speech"]`
    keeps the counts; this needs `vocab_size`, which says where the range ends. `codebooks` > 1 records that the
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
    if drop_non_speech and vocab_size is None:
        raise DatastoreError("drop_non_speech needs vocab_size: the speech range is speech_offset.."
                             "speech_offset + vocab_size - 1")
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
                       tuple(int(s) for s in stop_ids), tuple(int(d) for d in drop_ids), bool(drop_non_speech))
    started = time.perf_counter()
    files = corpus_files(corpus)
    shards, codebooks = int(shards), int(codebooks)
    work = pipeline.work_dir(target, files, {"speech_offset": vocab.speech_offset, "vocab_size": vocab.size,
                                             "stop_ids": vocab.stop_ids, "drop_ids": vocab.drop_ids,
                                             "codebooks": codebooks, "depth": int(n_max), "shards": shards,
                                             "per_speaker": bool(per_speaker),
                                             **({"drop_non_speech": True} if drop_non_speech else {})})
    remove_abandoned(target, "building")
    runner = pipeline.make_runner(ray, workers, shards)
    with atomic_dir(target, tag="building") as tmp:
        try:
            parts = pipeline.partition(work, files, vocab, codebooks, shards, per_speaker, runner, progress)
            meta = _meta(parts.vocab, codebooks, n_min, n_max, per_speaker, faiss, corpus, shards, parts.dropped)
            outcome, (speaker_utterances, rows_seconds) = _stores_beside_rows(
                tmp, meta, work, parts, codebooks, shards, per_speaker, int(n_max), runner, progress)
        except CorpusError:
            shutil.rmtree(work, ignore_errors=True)  # the corpus must change: nothing here will be reused
            raise
        finally:
            runner.close()
        outcome.seconds.update(rows_seconds)
        _assemble(tmp, work, outcome, speaker_utterances, faiss, embeddings, faiss_options, started)
    for leftover in target.parent.glob(f".{target.name}.work-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    return open_datastore(target)


def _stores_beside_rows(tmp: Path, meta: dict, work: Path, parts, codebooks, shards, per_speaker, depth, runner,
                        progress):
    """Build the stores while a process of its own writes the catalog and its utterance rows (rows.py); returns
    the stores' outcome, and the utterances per speaker with the rows' seconds."""
    from . import rows as catalog_rows  # imported here: `python -m echospec.datastore.rows` runs that module
    if sum(u["utterances"] for u in parts.units) < catalog_rows.ROWS_APART:
        outcome = pipeline.build_stores(work, parts, codebooks, shards, per_speaker, depth, runner, progress)
        return outcome, catalog_rows.write_catalog(tmp, meta, work, parts.units)
    rows = catalog_rows.RowsProcess(tmp, meta, work, parts.units)
    try:
        outcome = pipeline.build_stores(work, parts, codebooks, shards, per_speaker, depth, runner, progress)
    except BaseException:
        rows.kill()
        raise
    return outcome, rows.result(progress)


def _assemble(tmp: Path, work: Path, outcome, speaker_utterances: Counter, faiss, embeddings, faiss_options,
              started: float) -> None:
    """The datastore from the finished tasks in the temporary directory that the caller renames to the target:
    their stores linked in and recorded in the catalog, the FAISS store built over the shards."""
    vocab = outcome.vocab
    db = catalog.partial(tmp)
    shard_dirs = _place_shards(db, tmp, work, outcome)
    _place_speakers(db, tmp, work, outcome.groups, speaker_utterances)
    if faiss:
        from .faiss_store import write_faiss_store
        info = write_faiss_store(tmp / "faiss", shard_dirs, vocab.size, embeddings,
                                 speech_offset=vocab.speech_offset, **(faiss_options or {}))
        catalog.record_store(db, tmp, "faiss", tmp / "faiss", None, sum(u["utterances"] for u in outcome.units),
                             {"tokens": info.pop("vectors"), "segments": 0}, kind="faiss", params=info)
    catalog.set_meta(db, {"build_seconds": round(time.perf_counter() - started, 3),
                          "build_phases": outcome.seconds, "build_tasks": _task_report(outcome),
                          "layout_breaks": outcome.layout_breaks})
    catalog.finish(db, tmp)


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
        utterances = sum(u["shard_utterances"][i] for u in outcome.units)
        size = sum(r["bytes"] for r in rows)
        catalog.add_shard(db, rows, {"store": "general", "shard": i,
                                     "directory": directory.relative_to(tmp).as_posix(), "utterances": utterances,
                                     "segments": manifest["segments"], "tokens": manifest["tokens"], "bytes": size,
                                     "sha256": catalog.shard_digest(rows), "created_at": stamp})
        for key, value in (("utterances", utterances), ("segments", manifest["segments"]),
                           ("tokens", manifest["tokens"]), ("bytes", size)):
            total[key] += value
    catalog.add_stores(db, [{"name": "general", "kind": "exact", "directory": "general", "speaker": None,
                             **total, "created_at": stamp, "params": json.dumps({"shards": n})}])
    return directories


def _place_speakers(db, tmp: Path, work: Path, groups: list[dict], utterances: Counter) -> None:
    """Link every speaker store into the new datastore and record them, each table's rows in one insert
    (catalog.add_speaker_stores)."""
    files, stores, speakers = [], [], []
    stamp = catalog.now()
    for group, manifest in enumerate(groups):
        for row in manifest["speakers"]:
            name, directory = f"speaker:{row['name']}", tmp / "speakers" / row["directory"]
            _link_files(work / "speakers" / f"group-{group:05d}" / row["directory"], directory, row["files"])
            rows = _file_rows(tmp, name, directory, row["files"])
            files += rows
            stores.append({"name": name, "kind": "exact", "directory": directory.relative_to(tmp).as_posix(),
                           "speaker": row["name"], "utterances": utterances[row["name"]],
                           "segments": row["segments"], "tokens": row["tokens"],
                           "bytes": sum(r["bytes"] for r in rows), "created_at": stamp, "params": "{}"})
            speakers.append({"name": row["name"], "store": name, "utterances": utterances[row["name"]],
                             "tokens": row["tokens"], "enrolled_at": stamp})
    catalog.add_speaker_stores(db, files, stores, speakers)


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


def _meta(vocab: Vocabulary, codebooks, n_min, n_max, per_speaker, faiss, corpus, shards,
          dropped: dict | None = None) -> dict:
    return {"vocab_size": vocab.size, "speech_offset": vocab.speech_offset, "stop_ids": list(vocab.stop_ids),
            "drop_ids": list(vocab.drop_ids), "codebooks": int(codebooks),
            "dtype": stream_dtype(vocab.size).name, "n_min": int(n_min), "n_max": int(n_max),
            "sort_depth": int(n_max),
            "build": {"corpus": catalog.corpus_name(corpus), "per_speaker": per_speaker, "faiss": bool(faiss),
                      "shards": shards, **({"dropped_non_speech": dropped} if vocab.drop_non_speech else {})}}
