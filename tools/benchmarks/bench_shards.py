"""Sharded datastores: build throughput against workers, and proposals over S shards against one store.

One process run, one synthetic corpus (tools/corpus/synth_corpus.py, written as several JSONL files so the corpus
is read in parallel too), one held-out split:

- build: the same datastore (general store in `--build-shards` shards + per-speaker stores; no FAISS, which
  is one step on the driver) built with 1 and 2 local worker processes and on a local Ray cluster started with
  1 and 2 CPUs (`ray.init(num_cpus=...)` before the clock starts: a cluster is there before a build).
  Reported: tokens/s, efficiency = throughput / (workers x one worker's), bytes on disk per token, and each
  task's worker peak resident set (from the catalog's build_tasks) per token it sorted;
- proposals: stores of S = 1, 4, 16 shards over the same tokens (general store only), 16 nodes; p50/p99 over
  >= 10,000 contexts cut from held-out utterances, the stores interleaved every 50 calls in a fresh random order
  after a warm-up; oracle acceptance (tokens per step: longest tree path equal to the true next tokens + the
  verifier's bonus token) over the held-out utterances, with a 95% bootstrap interval, and the ratio to S = 1;
- the single-store builder alone and two at once (what side-by-side tasks can gain on this machine at all);
- a projection to a 15 B-token corpus from the measured figures;
- with `--phases`: builds in one process timed phase by phase (read, partition, sort, catalog, verify);
- with `--sort-baseline REV`: one store's arrays computed by REV's datastore/exact.py and today's, side by side.

    python -m echospec.tools.benchmarks.bench_shards --tokens 30000000 --out bench/shards
    python -m echospec.tools.benchmarks.bench_shards --tokens 50000000 --phases 1,4 --phases-only --out bench/phases
    python -m echospec.tools.benchmarks.bench_shards --tokens 200000000 --phases 1,16 --phases-only --keep \
        --sort-baseline 9ba753a --out bench/phases200
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from ...datastore import build, open_datastore
from ...datastore.files import atomic_file
from ...datastore.pipeline import SORT_BYTES_PER_TOKEN, TASK_BASE_BYTES
from ...retriever import Retriever
from ...retriever.tree import matched_depth
from ..bench.harness import pin_threads
from ..bench.machine import machine
from ..corpus.resample_corpus import Resampled, resample, write_npz
from ..corpus.synth_corpus import SynthConfig, generate
from .support.baselines import build_side_by_side, sort_side_by_side

THREADS = 1  # per process: the build's parallelism is its worker processes, pinned through the environment
BATCH = 50
TARGET_TOKENS = 15_000_000_000


def split_corpus(n_tokens: int, n_held: int, n_files: int, out: Path, seed: int):
    """Training corpus as `n_files` JSONL files; held-out utterances (of speakers that keep >= 3 in training)."""
    corpus = generate(SynthConfig(n_tokens=n_tokens, seed=seed))
    rng = np.random.default_rng(seed)
    counts = np.bincount(corpus.speakers)
    eligible = [i for i in range(len(corpus)) if counts[corpus.speakers[i]] >= 4 and len(corpus.utterance(i)) >= 20]
    held = set(rng.choice(eligible, min(n_held, len(eligible)), replace=False).tolist())
    files = [open(out / f"train-{k:02d}.jsonl", "w") for k in range(n_files)]
    n_train = 0
    for i in range(len(corpus)):
        if i in held:
            continue
        tokens = corpus.utterance(i)
        n_train += len(tokens)
        files[i % n_files].write(f'{{"id": "{corpus.utterance_id(i)}", "speaker": "{corpus.speaker_name(i)}", '
                                 f'"tokens": [{",".join(map(str, tokens.tolist()))}]}}\n')
    for f in files:
        f.close()
    held_tokens = [corpus.utterance(i).astype(np.int64) for i in sorted(held)]
    return str(out / "train-*.jsonl"), n_train, held_tokens


def split_resampled(n_tokens: int, n_held: int, n_files: int, out: Path, seed: int):
    """A resampled speech-like corpus (tools/corpus/resample_corpus.py: real sample tokens, perturbed) as
    `n_files` .npz files; held-out utterances drawn from the same process but never stored."""
    corpus = resample(n_tokens, seed)
    starts = np.concatenate([[0], np.cumsum(corpus.lengths)])
    rng = np.random.default_rng(seed)
    eligible = np.flatnonzero(corpus.lengths >= 20)
    held = np.sort(rng.choice(eligible, min(n_held, len(eligible)), replace=False))
    keep = np.ones(len(corpus.lengths), bool)
    keep[held] = False
    held_tokens = [corpus.tokens[starts[i]:starts[i + 1]].astype(np.int64) for i in held]
    token_keep = np.repeat(keep, corpus.lengths)
    train = Resampled(corpus.tokens[token_keep], corpus.lengths[keep], corpus.speakers[keep], corpus.vocab_size)
    write_npz(train, out, n_files, prefix="train")
    return str(out / "train-*.npz"), int(train.lengths.sum()), held_tokens


def phased_build(corpus: str, store: Path, shards: int, per_speaker: bool) -> dict:
    """One build in this process with every phase timed: reading the corpus alone (the batch readers, to
    the end), then the build (partition = reading + splitting into shard files, sort = the shard and
    speaker-store tasks, catalog = the rest: linking the stores in, the rename, the catalog rows where they
    were not written beside the sort; rows = the catalog rows' own seconds, beside the sort in a process of
    their own for big builds, whose CPU the catalog's counts), then opening it with --verify (every file's
    sha256, the catalog's integrity check)."""
    from ...datastore.corpus import Vocabulary, corpus_files, corpus_units, read_batches

    started, cpu = time.perf_counter(), time.process_time()
    tokens = sum(len(b.tokens) for unit in corpus_units(corpus_files(corpus)) for b in read_batches(unit, Vocabulary()))
    read, read_cpu = time.perf_counter() - started, time.process_time() - cpu
    cpu = time.process_time()
    built = timed_build(corpus, store, shards, per_speaker, workers=1)
    apart = built["phases"].get("catalog_rows_apart")  # the catalog rows' process is the build's CPU too
    build_cpu = time.process_time() - cpu + (built["phases"]["catalog_rows_cpu"] if apart else 0)
    started, cpu = time.perf_counter(), time.process_time()
    open_datastore(store, verify=True)
    verify, verify_cpu = time.perf_counter() - started, time.process_time() - cpu
    phases = {"read": read, "partition": built["phases"]["read"], "sort": built["phases"]["stores"],
              "catalog": built["assemble_seconds"], "verify": verify,
              "rows": built["phases"].get("catalog_rows", 0)}
    # CPU seconds: what the phase costs a core, whatever else the machine runs (this one is shared)
    cpu_phases = {"read": read_cpu, "partition": built["phases"].get("read_cpu", 0),
                  "sort": built["phases"].get("stores_cpu", 0), "verify": verify_cpu,
                  "rows": built["phases"].get("catalog_rows_cpu", 0)}
    cpu_phases["catalog"] = build_cpu - cpu_phases["partition"] - cpu_phases["sort"]
    return {**built, "read_tokens": tokens, "phase_seconds": phases, "phase_cpu_seconds": cpu_phases,
            "build_cpu_seconds": build_cpu,
            "phase_tokens_per_s": {k: built["tokens"] / v for k, v in phases.items() if v > 0},
            "phase_tokens_per_cpu_s": {k: built["tokens"] / v for k, v in cpu_phases.items() if v > 0}}


def timed_build(corpus: str, store: Path, shards: int, per_speaker: bool, workers: int | None = None,
                ray_cpus: int | None = None) -> dict:
    started = time.perf_counter()
    if ray_cpus is not None:
        import ray

        ray.init(num_cpus=ray_cpus, object_store_memory=256 << 20, include_dashboard=False,
                 log_to_driver=False, logging_level="ERROR")
        started = time.perf_counter()
        try:
            ds = build(corpus, store, shards=shards, ray="auto", per_speaker=per_speaker, faiss=False,
                       progress=False, force=True)
        finally:
            ray.shutdown()
    else:
        ds = build(corpus, store, shards=shards, workers=workers, per_speaker=per_speaker, faiss=False,
                   progress=False, force=True)
    seconds = time.perf_counter() - started
    info = ds.info()
    tasks = info["build_tasks"]
    return {"seconds": seconds, "phases": info["build_phases"], "tokens": info["tokens"],
            "utterances": info["utterances"],
            "assemble_seconds": seconds - info["build_phases"]["read"] - info["build_phases"]["stores"],
            "tokens_per_s": info["tokens"] / seconds,
            "general_bytes_per_token": info["general_bytes_per_token"],
            "exact_bytes_per_token": info["exact_bytes"] / info["tokens"],
            "peak_rss_mb": max(t["peak_rss_bytes"] for t in tasks) / 2**20,
            "task_tokens_max": max(t["tokens"] for t in tasks),
            "peak_rss_bytes_per_task_token": max(t["peak_rss_bytes"] / max(t["tokens"], 1) for t in tasks
                                                 if t["tokens"] >= 0.5 * max(u["tokens"] for u in tasks)),
            "shard_seconds_max": max(t["seconds"] for t in tasks if t["task"].startswith("shard")),
            "tasks": [[t["tokens"], t["peak_rss_bytes"]] for t in tasks if t["task"].startswith("shard")]}


def build_in_child(corpus: str, store: Path, shards: int, per_speaker: bool, workers: int | None = None,
                   ray_cpus: int | None = None, phased: bool = False) -> dict:
    """timed_build (or phased_build) in a fresh process, so that its peak resident set is the build's own."""
    call = (f"phased_build({corpus!r}, __import__('pathlib').Path({str(store)!r}), {shards}, {per_speaker})"
            if phased else f"timed_build({corpus!r}, __import__('pathlib').Path({str(store)!r}), {shards}, "
                           f"{per_speaker}, workers={workers}, ray_cpus={ray_cpus})")
    return _in_child(call)


def _in_child(call: str) -> dict:
    """A call of this module's in a fresh process (threads pinned through the environment it inherits), with
    that process's peak resident set."""
    code = ("import json; from echospec.tools.benchmarks.bench_shards import *; "
            "from echospec.datastore.tasks import peak_rss; "
            f"r = {call}; r['process_peak_rss_mb'] = peak_rss() / 2**20; print(json.dumps(r))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode:
        raise click.ClickException(f"{call} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def latency(retrievers: dict[int, Retriever], held: list[np.ndarray], calls: int, rounds: int, warmup: int):
    contexts = [(u, p) for u, h in enumerate(held) for p in range(1, len(h))]
    stride = max(1, len(contexts) // calls)
    contexts = contexts[::stride]
    rng = np.random.default_rng(0)
    for r in retrievers.values():
        for u, p in contexts[:: max(1, len(contexts) // warmup)]:
            r.propose(held[u][:p])
    times = {s: [] for s in retrievers}
    order = list(retrievers)
    for _ in range(rounds):
        for start in range(0, len(contexts), BATCH):
            batch = contexts[start:start + BATCH]
            for i in rng.permutation(len(order)):
                r, out = retrievers[order[i]], times[order[i]]
                for u, p in batch:
                    ctx = held[u][:p]
                    t0 = time.perf_counter_ns()
                    r.propose(ctx)
                    out.append(time.perf_counter_ns() - t0)
    return {s: {"p50_us": float(np.percentile(t, 50)) / 1000, "p99_us": float(np.percentile(t, 99)) / 1000,
                "calls": len(t)} for s, t in times.items()}


def oracle(retriever: Retriever, held: list[np.ndarray]) -> dict:
    """Tokens per step walking every held-out utterance (95% bootstrap interval over utterances)."""
    tokens, steps = [], []
    for utterance in held:
        pos, n = 1, 0
        while pos < len(utterance):
            tree = retriever.propose(utterance[:pos])
            accepted = matched_depth(tree.tokens, tree.parents, utterance[pos:])
            pos += min(accepted + 1, len(utterance) - pos)
            n += 1
        tokens.append(len(utterance) - 1)
        steps.append(n)
    tokens, steps = np.asarray(tokens, float), np.asarray(steps, float)
    draws = np.random.default_rng(0).integers(0, len(tokens), (1000, len(tokens)))
    boot = tokens[draws].sum(1) / steps[draws].sum(1)
    return {"tokens_per_step": float(tokens.sum() / steps.sum()),
            "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))]}


def memory_fit(tasks: list[list[int]]) -> dict:
    """Peak resident set of a shard task against the tokens it sorts, fitted over tasks of two sizes run
    in worker processes of their own (the S = 4 and 16 builds): bytes per token and the fixed part; with tasks
    of one size only (--latency-shards 1,4), their peak per token with no fixed part."""
    tokens, peak = np.asarray(tasks, float).T
    points = [[int(t), int(p)] for t, p in zip(tokens, peak)]
    if tokens.max() < 1.5 * tokens.min():  # one size (a single S > 1): a line through them is noise, not a fit
        return {"bytes_per_token": float(np.median(peak / tokens)), "base_mb": 0.0, "points": points}
    slope, intercept = np.polyfit(tokens, peak, 1)
    return {"bytes_per_token": float(slope), "base_mb": float(intercept) / 2**20, "points": points}


def sort_alone_and_in_pairs(tokens: int) -> dict:
    """The single-store builder on `tokens` random tokens, alone and two at once in two processes: what
    running tasks side by side gains on this machine, whatever the pipeline around them does."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_sort_random, [tokens // 10] * 2))  # imports and JIT cache loaded in both
        alone = list(pool.map(_sort_random, [tokens]))[0]
        pair = max(pool.map(_sort_random, [tokens, tokens]))
    return {"tokens": tokens, "alone_s": alone, "two_at_once_s": pair, "efficiency": alone / pair}


def _sort_random(tokens: int) -> float:
    import tempfile

    from ...datastore.exact import write_exact_store

    stream = np.random.default_rng(tokens).integers(0, 6561, tokens).astype(np.uint16)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        write_exact_store(Path(tmp), np.split(stream, np.arange(200, tokens, 200)), 6561, 8)
        return time.perf_counter() - started


def projection(builds: dict, memory: dict, pairs: dict) -> dict:
    """15 B tokens on paper, from the measured figures: one worker's whole-build throughput (reading, the
    general shards and the speaker stores), a shard task's memory, the driver's catalog rate, and how much
    two tasks side by side gain (this machine's pair efficiency as the low end, 1 as the high end)."""
    one = builds["local, 1 worker"]
    shard_tokens = 500_000_000  # 30 shards, each a quarter of the int32 limit
    peak = memory["bytes_per_token"] * shard_tokens + memory["base_mb"] * 2**20
    reserved = SORT_BYTES_PER_TOKEN * shard_tokens + TASK_BASE_BYTES  # what Ray reserves for the task
    node_memory = 128 << 30
    nodes, per_node = 8, int(node_memory // reserved)
    worker_hours = TARGET_TOKENS / one["tokens_per_s"] / 3600
    driver_hours = TARGET_TOKENS / one["tokens"] * one["assemble_seconds"] / 3600
    return {"tokens": TARGET_TOKENS, "shards": TARGET_TOKENS // shard_tokens, "worker_hours": worker_hours,
            "task_peak_gb": peak / 1e9, "task_reserved_gb": reserved / 1e9, "node_memory_gb": node_memory / 2**30,
            "nodes": nodes, "tasks_per_node": per_node, "driver_hours": driver_hours,
            "hours_side_by_side_as_alone": worker_hours / (nodes * per_node) + driver_hours,
            "hours_as_this_machine": worker_hours / (nodes * per_node * pairs["efficiency"]) + driver_hours,
            "disk_tb": TARGET_TOKENS * one["exact_bytes_per_token"] / 1e12,
            "work_disk_tb": TARGET_TOKENS * (one["exact_bytes_per_token"] + 4) / 1e12,
            "general_store_gb": TARGET_TOKENS * one["general_bytes_per_token"] / 1e9}


@click.command()
@click.option("--tokens", "n_tokens", type=click.IntRange(min=100_000), default=30_000_000, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--files", "n_files", type=click.IntRange(min=1), default=8, show_default=True,
              help="JSONL files the training corpus is written as")
@click.option("--build-shards", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--latency-shards", default="1,4,16", show_default=True)
@click.option("--workers", "worker_counts", default="1,2", show_default=True)
@click.option("--ray/--no-ray", "use_ray", default=True, show_default=True, help="also build on a local Ray cluster")
@click.option("--held-out", "n_held", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--calls", type=click.IntRange(min=100), default=10_000, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--corpus", "kind", type=click.Choice(["resampled", "synth"]), default="resampled", show_default=True,
              help="resampled: the sample's real tokens resampled and perturbed, as .npz; synth: the phrase-list "
                   "generator, as JSONL")
@click.option("--phases", "phase_shards", default="1,4", show_default=True,
              help="shard counts of the builds timed phase by phase (one process each, general + speaker stores)")
@click.option("--phases-only", is_flag=True, help="only the phase-timed builds (the largest corpora)")
@click.option("--sort-baseline", default=None,
              help="also time one store's sort side by side with datastore/exact.py at this git revision")
@click.option("--sort-tokens", type=click.IntRange(min=100_000), default=20_000_000, show_default=True)
@click.option("--build-baseline", default=None,
              help="also time whole one-process builds (each --phases shard count) side by side with "
                   "echospec.datastore at this git revision, alternating --rounds times")
@click.option("--keep", is_flag=True, help="keep the phase-timed stores and write the held-out utterances to "
                                           "OUT/held.npz (for bench_pages --store OUT/store-phased-S --held ...)")
def main(n_tokens, out, n_files, build_shards, latency_shards, worker_counts, use_ray, n_held, calls, rounds, seed,
         kind, phase_shards, phases_only, sort_baseline, sort_tokens, build_baseline, keep):
    """Build throughput against workers and proposals over shards; writes OUT/shards.json and OUT/shards.md."""
    if not phases_only and all(int(x) <= 1 for x in latency_shards.split(",") if x):
        raise click.BadParameter("needs a shard count above 1: a shard task's memory is fitted over those builds' "
                                 "tasks", param_hint="--latency-shards")
    pin_threads(THREADS)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    sort = None
    if sort_baseline:
        sort = _in_child(f"sort_side_by_side({sort_tokens}, {sort_baseline!r}, {rounds}, {seed})")
        click.echo(f"one store's sort, {sort['tokens'] / 1e6:.1f} M tokens: {sort['speedup_cpu']:.2f}x the CPU "
                   f"speed of {sort_baseline} ({json.dumps(sort)})")
    split = split_resampled if kind == "resampled" else split_corpus
    corpus, n_train, held = split(n_tokens, n_held, n_files, out, seed)
    click.echo(f"corpus ({kind}): {n_train} training tokens in {n_files} files, {len(held)} held-out utterances "
               f"({time.perf_counter() - started:.0f} s)")
    if keep:
        np.savez(out / "held.npz", tokens=np.concatenate(held), lengths=np.array([len(h) for h in held]))
    phased = {}
    for s in [int(x) for x in phase_shards.split(",") if x]:
        phased[s] = build_in_child(corpus, out / f"store-phased-{s}", s, True, phased=True)
        click.echo(f"phases, {s} shard{'s' * (s > 1)}: " + ", ".join(
            f"{k} {v:.1f} s" for k, v in phased[s]["phase_seconds"].items())
            + f"; end to end {phased[s]['tokens_per_s'] / 1e6:.2f} M tokens/s, peak {phased[s]['process_peak_rss_mb']:.0f} MB")
        if not keep:
            shutil.rmtree(out / f"store-phased-{s}")
        if build_baseline:
            side = build_side_by_side(corpus, out, s, build_baseline, rounds)
            phased[s]["build_side_by_side"] = side
            click.echo(f"whole build, {s} shard{'s' * (s > 1)}, side by side with {build_baseline}: "
                       f"{side['median_seconds']['baseline']:.1f} s -> {side['median_seconds']['now']:.1f} s (median "
                       f"of {rounds}; now / baseline per round: "
                       + ", ".join(f"{r:.2f}" for r in side["time_ratios"]) + ")")
    if phases_only:
        result = {"machine": machine(threads=THREADS), "corpus": kind, "corpus_tokens": n_train, "phased": phased,
                  "sort_side_by_side": sort, "seconds": time.perf_counter() - started}
        with atomic_file(out / "phases.json") as f:
            json.dump(result, f, indent=2)
        click.echo(phases_markdown(result))
        return
    workers = [int(w) for w in worker_counts.split(",")]
    builds = {}
    for mode in ["local"] + ["ray"] * use_ray:
        for w in workers:
            name = f"{mode}, {w} worker{'s' * (w > 1)}"
            store = out / f"store-{mode}-{w}"
            builds[name] = build_in_child(corpus, store, build_shards, True, workers=w if mode == "local" else None,
                                          ray_cpus=w if mode == "ray" else None)
            builds[name]["workers"] = w
            click.echo(f"build {name}: {builds[name]['tokens_per_s'] / 1e6:.2f} M tokens/s, "
                       f"peak {builds[name]['peak_rss_mb']:.0f} MB a task, phases {builds[name]['phases']}")
            if (mode, w) != ("local", max(workers)):
                shutil.rmtree(store)
    pairs = sort_alone_and_in_pairs(min(n_train, 15_000_000))
    click.echo(f"single-store builds, alone {pairs['alone_s']:.1f} s, two at once {pairs['two_at_once_s']:.1f} s")
    shard_counts = [int(s) for s in latency_shards.split(",")]
    stores, retrievers, tasks = {}, {}, []
    for s in shard_counts:
        store = out / f"store-general-{s}"
        built = build_in_child(corpus, store, s, False, workers=max(workers))
        if s > 1:  # one shard is built in the process that read the corpus: its peak is not the task's alone
            tasks += built["tasks"]
        stores[s] = {"bytes_per_token": built["general_bytes_per_token"], "build_tokens_per_s": built["tokens_per_s"]}
        retrievers[s] = Retriever(open_datastore(store), use_faiss=False)
    timings = latency(retrievers, held, calls, rounds, warmup=500)
    for s in shard_counts:
        stores[s].update(timings[s])
        stores[s].update(oracle(retrievers[s], held))
        stores[s]["acceptance_ratio"] = stores[s]["tokens_per_step"] / stores[shard_counts[0]]["tokens_per_step"]
        click.echo(f"S={s}: p50 {stores[s]['p50_us']:.1f} us, p99 {stores[s]['p99_us']:.1f} us, "
                   f"{stores[s]['tokens_per_step']:.3f} tokens/step ({stores[s]['acceptance_ratio']:.4f}x)")
    one = next(iter(builds.values()))
    for b in builds.values():
        b["speedup"] = b["tokens_per_s"] / one["tokens_per_s"]
        b["efficiency"] = b["speedup"] / b["workers"]
    result = {"machine": machine(threads=THREADS), "corpus": kind, "phased": phased, "sort_side_by_side": sort,
              "corpus_tokens": n_train, "held_out": len(held), "build_shards": build_shards,
              "builds": builds, "sort_pairs": pairs, "stores": stores, "task_memory": memory_fit(tasks),
              "projection": projection(builds, memory_fit(tasks), pairs),
              "seconds": time.perf_counter() - started}
    with atomic_file(out / "shards.json") as f:
        json.dump(result, f, indent=2)
    with atomic_file(out / "shards.md") as f:
        f.write(phases_markdown(result) + "\n" + markdown(result))
    click.echo(phases_markdown(result) + "\n" + markdown(result))


def phases_markdown(result: dict) -> str:
    lines = [f"Phases: {result['corpus_tokens'] / 1e6:.1f} M tokens ({result['corpus']}), one process, general + "
             "speaker stores; seconds (M tokens/s)", "",
             "| shards | clock | read | partition | sort | catalog | verify | build end to end | peak RSS "
             "| catalog rows (beside sort) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s, b in result["phased"].items():
        for clock, seconds, rate in (("wall", "phase_seconds", "phase_tokens_per_s"),
                                     ("CPU", "phase_cpu_seconds", "phase_tokens_per_cpu_s")):
            if seconds not in b:
                continue
            cells = [f"{b[seconds][k]:.1f} ({b[rate].get(k, 0) / 1e6:.1f})"
                     for k in ("read", "partition", "sort", "catalog", "verify")]
            total = b["seconds"] if clock == "wall" else b["build_cpu_seconds"]
            lines.append(f"| {s} | {clock} | " + " | ".join(cells) + f" | {total:.1f} ({b['tokens'] / total / 1e6:.2f}) | "
                         f"{b['process_peak_rss_mb']:.0f} MB ({b['process_peak_rss_mb'] * 2**20 / b['tokens']:.0f} B/token) | "
                         f"{b[seconds].get('rows', 0):.1f}"
                         f"{'' if b['phases'].get('catalog_rows_apart') else ' (after)'} |")
    return "\n".join(lines) + "\n"


def markdown(result: dict) -> str:
    lines = [f"Build: {result['corpus_tokens'] / 1e6:.1f} M tokens, {result['build_shards']} shards + speaker stores",
             "", "| build | M tokens/s | speed-up | efficiency | read / stores s | B/token on disk (general) | "
             "peak RSS a task (MB) | peak B per sorted token |", "|---|---|---|---|---|---|---|---|"]
    for name, b in result["builds"].items():
        lines.append(f"| {name} | {b['tokens_per_s'] / 1e6:.2f} | {b['speedup']:.2f}x | {b['efficiency']:.2f} | "
                     f"{b['phases']['read']:.1f} / {b['phases']['stores']:.1f} | "
                     f"{b['exact_bytes_per_token']:.2f} ({b['general_bytes_per_token']:.2f}) | {b['peak_rss_mb']:.0f} | "
                     f"{b['peak_rss_bytes_per_task_token']:.0f} |")
    lines += ["", "| shards | propose p50 µs | p99 µs | oracle tokens/step [95% CI] | vs 1 shard |", "|---|---|---|---|---|"]
    for s, r in result["stores"].items():
        lines.append(f"| {s} | {r['p50_us']:.1f} | {r['p99_us']:.1f} | {r['tokens_per_step']:.3f} "
                     f"[{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}] | {r['acceptance_ratio']:.4f} |")
    m, q, p = result["task_memory"], result["sort_pairs"], result["projection"]
    lines += ["", f"Shard task peak memory: {m['base_mb']:.0f} MB + {m['bytes_per_token']:.1f} B per token it sorts "
              f"(fit over {len(m['points'])} shard tasks of the S > 1 builds). The single-store builder on "
              f"{q['tokens'] / 1e6:.0f} M tokens: {q['alone_s']:.1f} s alone, {q['two_at_once_s']:.1f} s two at once "
              f"(pair efficiency {q['efficiency']:.2f}).",
              "", f"15 B tokens on paper: {p['worker_hours']:.1f} worker-hours; {p['shards']} shards of 0.5 B tokens, "
              f"a shard task peaking at {p['task_peak_gb']:.0f} GB (Ray reserves {p['task_reserved_gb']:.0f} GB); "
              f"{p['nodes']} nodes of {p['node_memory_gb']:.0f} GB run {p['tasks_per_node']} tasks each: "
              f"{p['hours_side_by_side_as_alone']:.2f} h (tasks side by side as fast as alone) to "
              f"{p['hours_as_this_machine']:.2f} h (at this machine's pair efficiency), of which {p['driver_hours']:.2f} h "
              "the driver's catalog; "
              f"{p['disk_tb']:.2f} TB of stores ({p['work_disk_tb']:.2f} TB while building), "
              f"{p['general_store_gb']:.0f} GB of general store to map when serving."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
