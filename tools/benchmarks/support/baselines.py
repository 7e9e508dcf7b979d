"""This checkout's store builds and sorts side by side with a baseline revision's (bench_shards --baseline):
the baseline's echospec.datastore from `git archive`, alternating with today's in fresh processes."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from ...corpus.resample_corpus import resample

REPO = Path(__file__).resolve().parents[3]


def baseline_module(revision: str, repo: Path = REPO, path: str = "datastore/corpus.py"):
    """A module of the datastore (`path`) as it was at `revision`, imported beside today's (same package,
    other name) from a file of its own, so numba can cache its kernels."""
    source = subprocess.run(["git", "-C", str(repo), "show", f"{revision}:{path}"], check=True,
                            capture_output=True, text=True).stdout
    name = f"_{Path(path).stem}_{revision}"
    file = Path(tempfile.gettempdir()) / "echospec-baselines" / f"{name}.py"
    file.parent.mkdir(exist_ok=True)
    if not file.exists() or file.read_text() != source:
        file.write_text(source)
    spec = importlib.util.spec_from_file_location(f"echospec.datastore.{name}", file)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "echospec.datastore"
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def sort_side_by_side(n_tokens: int, baseline: str, rounds: int, seed: int) -> dict:
    """A store's arrays (stream, sa, first, index: what write_exact_stream computes) from one resampled corpus
    by `baseline`'s datastore/exact.py and today's, alternating over `rounds` after a warm-up, in CPU seconds
    (this machine is shared) and wall seconds; the two must give identical arrays."""
    from ....datastore import exact

    old = baseline_module(baseline, path="datastore/exact.py")
    corpus = resample(n_tokens, seed)
    segments = np.split(corpus.tokens, np.cumsum(corpus.lengths)[:-1])
    vocab = corpus.vocab_size

    def arrays(module):
        stream = module.concat_segments(segments, vocab)
        sa = module.suffix_array(stream, vocab, 8)
        return stream, sa, module.first_index(stream, sa, vocab), module.sampled_index(stream, sa, vocab, 8)

    small = segments[:1000]
    for module in (old, exact):  # compile (or load the cache) outside the clock
        module.suffix_array(module.concat_segments(small, vocab), vocab, 8)
    times = {"baseline": [], "now": []}
    for _ in range(rounds):
        results = {}
        for key, module in (("baseline", old), ("now", exact)):
            wall, cpu = time.perf_counter(), time.process_time()
            results[key] = arrays(module)
            times[key].append((time.process_time() - cpu, time.perf_counter() - wall))
        assert all(np.array_equal(a, b) for a, b in zip(results["baseline"], results["now"])), "arrays differ"
        del results
    tokens = int(corpus.lengths.sum())
    row = {k: {"cpu_s": sorted(c for c, _ in v), "wall_s": sorted(w for _, w in v)} for k, v in times.items()}
    for v in row.values():
        v["m_tokens_per_cpu_s"] = tokens / float(np.median(v["cpu_s"])) / 1e6
    return {"baseline": baseline, "tokens": tokens, "rounds": rounds, **row,
            "speedup_cpu": float(np.median(row["baseline"]["cpu_s"]) / np.median(row["now"]["cpu_s"]))}


BUILD_CALL = ("import json, sqlite3, sys, time; from echospec.datastore import build; started = time.perf_counter(); "
              "build(sys.argv[1], sys.argv[2], shards=int(sys.argv[3]), workers=1, faiss=False, progress=False, "
              "force=True); seconds = time.perf_counter() - started; "
              "meta = dict(sqlite3.connect(sys.argv[2] + '/catalog.sqlite').execute('SELECT key, value FROM meta')); "
              "print(json.dumps({'seconds': seconds, 'phases': json.loads(meta['build_phases'])}))")


def build_side_by_side(corpus: str, out: Path, shards: int, baseline: str, rounds: int) -> dict:
    """One-process builds (general + speaker stores) by `baseline`'s echospec.datastore and today's, alternating
    over `rounds`, each in a fresh process: the whole build, what one phase's figures cannot show."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(baseline_package(baseline)),
                                                                     os.environ.get("PYTHONPATH")]))}
    warm_up = out / "warm-up.jsonl"  # a small build first, outside the clock: numba compiles (or loads its cache)
    warm_up.write_text("".join(json.dumps({"id": f"w{i}", "speaker": "s", "tokens": [i % 7, 3, 5, i % 11]}) + "\n"
                               for i in range(50)))
    runs = {"baseline": [], "now": []}
    for timed in [False] + [True] * rounds:
        for key, environment in (("baseline", env), ("now", None)):
            store = out / f"store-side-by-side-{shards}"
            done = subprocess.run([sys.executable, "-c", BUILD_CALL, corpus if timed else str(warm_up), str(store),
                                   str(shards)], env=environment, capture_output=True, text=True)
            if done.returncode:
                raise click.ClickException(f"the {key} build failed:\n{done.stderr[-3000:]}")
            if timed:
                runs[key].append(json.loads(done.stdout.strip().splitlines()[-1]))
            shutil.rmtree(store)
    median = {k: float(np.median([r["seconds"] for r in v])) for k, v in runs.items()}
    return {"baseline": baseline, "shards": shards, "rounds": rounds, "runs": runs, "median_seconds": median,
            "time_ratio": median["now"] / median["baseline"],
            "time_ratios": [n["seconds"] / b["seconds"] for b, n in zip(runs["baseline"], runs["now"])]}


def baseline_package(revision: str) -> Path:
    """A folder holding echospec/datastore as it was at `revision` (git archive): first on PYTHONPATH, it is the
    echospec.datastore a build imports (a build needs nothing else of echospec)."""

    root = Path(tempfile.gettempdir()) / "echospec-baselines" / f"package-{revision}"
    if not (root / "echospec" / "datastore").is_dir():
        archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "datastore"], check=True,
                                 capture_output=True).stdout
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root.parent))
        (tmp / "echospec").mkdir()
        tarfile.open(fileobj=io.BytesIO(archive)).extractall(tmp / "echospec", filter="data")
        (tmp / "echospec" / "__init__.py").touch()
        shutil.rmtree(root, ignore_errors=True)
        tmp.rename(root)
    return root
