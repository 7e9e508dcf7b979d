"""Proposals from a cold page cache: how much of a store they read and map, and what a miss costs.

One general store (one shard, built from a resampled speech-like corpus unless --store names one), contexts cut
from held-out utterances. Each variant runs in a fresh process, after the store's pages are dropped from
the page cache (fsync, then posix_fadvise(DONTNEED) on every file): `--proposals` proposals from cold, then
the same again warm. Variants, alternated over `--rounds` rounds:

  before           no sampled index, the kernel's read-around (what the store did before index.npy)
  random           no sampled index, the maps advised MADV_RANDOM
  index            the sampled index and MADV_RANDOM (open_datastore(access="random"): what a store does where
                   it does not fit in half the available memory)
  index-stream     the sampled index, the stream read into memory when the store opens and the suffix array
                   advised MADV_RANDOM (access="stream": a replica with RAM for the stream, not the store)
  index-readahead  the sampled index and the read-around (access="readahead": what a store that fits does)

Reported per variant (median over rounds): the share of the store's pages the process maps after the cold
proposals (its file-backed resident set, from /proc/self/smaps, against the files' sizes) per file, major page
faults per proposal (getrusage), p50/p99 of the cold and the warm proposals in microseconds, and the seconds
opening the store took (reading the stream in, for index-stream).

    python -m echospec.tools.benchmarks.bench_pages --tokens 20000000 --out bench/pages
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import click
import numpy as np

from ...datastore.files import atomic_file

VARIANTS = ("before", "random", "index", "index-stream", "index-readahead")
_RANGE = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def make_store(n_tokens: int, out: Path, n_held: int, seed: int) -> tuple[Path, Path]:
    """A general store over a resampled corpus, and the held-out utterances (.npz: tokens, lengths)."""
    from ...datastore import build
    from ..corpus.resample_corpus import Resampled, resample, write_npz

    corpus = resample(n_tokens, seed)
    rng = np.random.default_rng(seed)
    held = np.sort(rng.choice(np.flatnonzero(corpus.lengths >= 20), n_held, replace=False))
    keep = np.ones(len(corpus.lengths), bool)
    keep[held] = False
    train = Resampled(corpus.tokens[np.repeat(keep, corpus.lengths)], corpus.lengths[keep], corpus.speakers[keep],
                      corpus.vocab_size)
    write_npz(train, out / "corpus", 2)
    starts = np.concatenate([[0], np.cumsum(corpus.lengths)])
    np.savez(out / "held.npz", tokens=np.concatenate([corpus.tokens[starts[i]:starts[i + 1]] for i in held]),
             lengths=corpus.lengths[held])
    build(str(out / "corpus" / "*.npz"), out / "store", per_speaker=False, faiss=False, progress=False, force=True)
    return out / "store", out / "held.npz"


def contexts(held: Path, n: int) -> list[np.ndarray]:
    """`n` contexts, the same number from each held-out utterance, at evenly spread lengths."""
    with np.load(held) as data:
        tokens, lengths = data["tokens"].astype(np.int64), data["lengths"]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    per = -(-n // len(lengths))
    out = [tokens[starts[i]:starts[i] + p] for i in range(len(lengths))
           for p in np.linspace(2, lengths[i] - 1, per).astype(int)]
    return out[:n]


def drop_cache(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def mapped_kb(prefix: str) -> dict[str, int]:
    """Resident kB of each file under `prefix` mapped in this process (/proc/self/smaps)."""
    out, current = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            if _RANGE.match(line):
                fields = line.split()
                current = fields[5] if len(fields) >= 6 and fields[5].startswith(prefix) else None
            elif current and line.startswith("Rss:"):
                out[current] = out.get(current, 0) + int(line.split()[1])
    return out


def run_variant(store: str, held: str, variant: str, n: int) -> dict:
    """In a fresh process: drop the store's pages, open it, `n` proposals cold, then warm."""
    from ...datastore import open_datastore
    from ...retriever import Retriever, replay

    general = Path(store) / "general"
    files = sorted(general.rglob("*.npy"))
    ctxs = contexts(Path(held), n)
    drop_cache(files)
    access = {"before": "readahead", "index-readahead": "readahead", "index-stream": "stream"}.get(variant, "random")
    opened = time.perf_counter()
    r = Retriever(open_datastore(store, access=access), use_faiss=False)
    opened = time.perf_counter() - opened
    if not variant.startswith("index"):
        replay.without_index(r)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    cold = _timed(r, ctxs)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults
    mapped = mapped_kb(str(general.resolve()))
    warm = _timed(r, ctxs)
    sizes = {str(p.resolve()): p.stat().st_size for p in files}
    return {"variant": variant, "proposals": len(ctxs), "open_s": opened,
            "major_faults_per_proposal": faults / len(ctxs),
            "mapped_share": sum(mapped.values()) * 1024 / sum(sizes.values()),
            "mapped_share_by_file": {Path(k).name: mapped.get(k, 0) * 1024 / v for k, v in sizes.items()},
            "cold_p50_us": float(np.percentile(cold, 50)), "cold_p99_us": float(np.percentile(cold, 99)),
            "warm_p50_us": float(np.percentile(warm, 50)), "warm_p99_us": float(np.percentile(warm, 99))}


def _timed(r, ctxs) -> np.ndarray:
    out = np.empty(len(ctxs))
    for i, ctx in enumerate(ctxs):
        t = time.perf_counter_ns()
        r.propose(ctx)
        out[i] = (time.perf_counter_ns() - t) / 1000
    return out


def in_child(store: Path, held: Path, variant: str, n: int) -> dict:
    code = ("import json; from echospec.tools.benchmarks.bench_pages import run_variant; "
            f"print(json.dumps(run_variant({str(store)!r}, {str(held)!r}, {variant!r}, {n})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"})
    if done.returncode:
        raise click.ClickException(f"{variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@click.command()
@click.option("--tokens", "n_tokens", type=click.IntRange(min=100_000), default=20_000_000, show_default=True)
@click.option("--store", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="an existing datastore (then --held names its held-out .npz) instead of building one")
@click.option("--held", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
@click.option("--proposals", type=click.IntRange(min=10), default=3000, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--variants", default=",".join(VARIANTS), show_default=True, help="which to run, comma-separated")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
def main(n_tokens, store, held, proposals, rounds, seed, variants, out):
    """Cold-cache proposals: pages mapped, major faults, latency; the variants side by side."""
    out.mkdir(parents=True, exist_ok=True)
    if store is None:
        store, held = make_store(n_tokens, out, 300, seed)
    chosen = [v.strip() for v in variants.split(",") if v.strip()]
    if not chosen or set(chosen) - set(VARIANTS):
        raise click.BadParameter(f"choose among {', '.join(VARIANTS)}", param_hint="--variants")
    runs = {v: [] for v in chosen}
    for _ in range(rounds):
        for variant in chosen:
            runs[variant].append(in_child(store, held, variant, proposals))
            click.echo(json.dumps(runs[variant][-1]), err=True)
    keys = ("open_s", "mapped_share", "major_faults_per_proposal", "cold_p50_us", "cold_p99_us", "warm_p50_us",
            "warm_p99_us")
    summary = {v: {k: float(np.median([r[k] for r in rs])) for k in keys} | {
        "mapped_share_by_file": {f: float(np.median([r["mapped_share_by_file"][f] for r in rs]))
                                 for f in rs[0]["mapped_share_by_file"]}} for v, rs in runs.items()}
    result = {"store": str(store), "proposals": proposals, "rounds": rounds, "load_average": os.getloadavg(),
              "summary": summary, "runs": runs}
    with atomic_file(out / "pages.json") as f:
        json.dump(result, f, indent=2)
    lines = ["| variant | open s | pages mapped | by file | major faults / proposal | cold p50 / p99 µs | "
             "warm p50 / p99 µs |", "|---|---|---|---|---|---|---|"]
    for v, s in summary.items():
        files = ", ".join(f"{name} {share:.0%}" for name, share in sorted(s["mapped_share_by_file"].items()))
        lines.append(f"| {v} | {s['open_s']:.2f} | {s['mapped_share']:.1%} | {files} | "
                     f"{s['major_faults_per_proposal']:.2f} | {s['cold_p50_us']:.0f} / {s['cold_p99_us']:.0f} | "
                     f"{s['warm_p50_us']:.0f} / {s['warm_p99_us']:.0f} |")
    click.echo("\n".join(lines))


if __name__ == "__main__":
    main()
