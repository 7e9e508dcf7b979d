"""Reading a corpus: the batch readers (whole arrays checked at once) against the per-utterance readers of a
baseline revision, side by side in one process run.

The same resampled speech-like corpus (tools/corpus/resample_corpus.py) is written as .npz, Parquet, JSONL
and a JSONL manifest of .npy files; each reader reads every file to the end (every id checked and mapped to
local ids, as a build's partition task reads them), the baseline and the candidate alternating over
`--rounds` rounds after a warm-up. Reported: M tokens/s (median, min, max) and the ratio of the medians.

    python -m echospec.tools.benchmarks.bench_ingest --tokens 20000000 --baseline 5122318 --out bench/ingest
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
import numpy as np

from ...datastore import corpus as candidate
from ...datastore.files import atomic_file
from ..bench.machine import machine
from ..corpus.resample_corpus import resample, write_npz
from .support.baselines import REPO, baseline_module

VOCAB = candidate.Vocabulary(speech_offset=0, size=4096)


def write_formats(n_tokens: int, out: Path, seed: int) -> dict[str, list[str]]:
    corpus = resample(n_tokens, seed)
    files = {"npz": [str(p) for p in write_npz(corpus, out / "npz", 4)]}
    starts = np.concatenate([[0], np.cumsum(corpus.lengths)])
    ids = [f"u{i:09d}" for i in range(len(corpus.lengths))]
    speakers = [f"spk{s:04d}" for s in corpus.speakers]
    import pyarrow as pa
    import pyarrow.parquet as pq

    (out / "parquet").mkdir(exist_ok=True)
    values = pa.array(corpus.tokens.astype(np.int32))
    table = pa.table({"id": ids, "speaker": speakers,
                      "tokens": pa.ListArray.from_arrays(pa.array(starts.astype(np.int32)), values)})
    pq.write_table(table, out / "parquet" / "corpus.parquet", row_group_size=1 << 16)
    files["parquet"] = [str(out / "parquet" / "corpus.parquet")]
    (out / "jsonl").mkdir(exist_ok=True)
    with open(out / "jsonl" / "corpus.jsonl", "w") as f:
        for i in range(len(ids)):
            tokens = ",".join(map(str, corpus.tokens[starts[i]:starts[i + 1]].tolist()))
            f.write(f'{{"id": "{ids[i]}", "speaker": "{speakers[i]}", "tokens": [{tokens}]}}\n')
    files["jsonl"] = [str(out / "jsonl" / "corpus.jsonl")]
    (out / "npy").mkdir(exist_ok=True)
    n_npy = min(len(ids), 20_000)  # one file per utterance: a manifest's cost is per file, so fewer of them
    with open(out / "npy" / "manifest.jsonl", "w") as f:
        for i in range(n_npy):
            np.save(out / "npy" / f"{ids[i]}.npy", corpus.tokens[starts[i]:starts[i + 1]].astype(np.uint16))
            f.write(json.dumps({"id": ids[i], "speaker": speakers[i], "path": f"{ids[i]}.npy"}) + "\n")
    files["npy"] = [str(out / "npy" / "manifest.jsonl")]
    return files


def read_old(module, files: list[str]) -> int:
    tokens = 0
    for utt in module.read_corpus(files, module.Vocabulary(speech_offset=0, size=4096)):
        tokens += len(utt.tokens)
    return tokens


def read_new(files: list[str]) -> int:
    tokens = 0
    for unit in candidate.corpus_units(candidate.corpus_files(files)):
        for batch in candidate.read_batches(unit, VOCAB):
            tokens += len(batch.tokens)
    return tokens


def main_run(n_tokens: int, baseline: str, out: Path, rounds: int, seed: int, repo: Path = REPO) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    old = baseline_module(baseline, repo)
    started = time.perf_counter()
    formats = write_formats(n_tokens, out, seed)
    print(f"corpus written in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    result = {"machine": machine(), "baseline": baseline, "rounds": rounds, "formats": {}}
    for name, files in formats.items():
        systems = {"baseline": lambda f=files: read_old(old, f), "batches": lambda f=files: read_new(f)}
        counts = {key: run() for key, run in systems.items()}  # warm-up, and the two must agree
        assert counts["baseline"] == counts["batches"], (name, counts)
        times: dict[str, list[float]] = {key: [] for key in systems}
        for _ in range(rounds):
            for key, run in systems.items():
                t = time.perf_counter()
                run()
                times[key].append(time.perf_counter() - t)
        rates = {key: [counts[key] / s / 1e6 for s in values] for key, values in times.items()}
        row = {"tokens": counts["batches"],
               **{key: {"median": float(np.median(r)), "min": min(r), "max": max(r)} for key, r in rates.items()}}
        row["speedup"] = row["batches"]["median"] / row["baseline"]["median"]
        result["formats"][name] = row
        print(name, json.dumps(row), file=sys.stderr)
    return result


@click.command()
@click.option("--tokens", "n_tokens", type=click.IntRange(min=10_000), default=20_000_000, show_default=True)
@click.option("--baseline", default="5122318", show_default=True, help="Git revision of the readers to compare.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--repo", type=click.Path(file_okay=False, path_type=Path), default=REPO, show_default=True,
              help="The git checkout to read the baseline revision from.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
def main(n_tokens: int, baseline: str, rounds: int, seed: int, repo: Path, out: Path) -> None:
    """Read one corpus in four formats with the baseline's readers and today's; M tokens/s side by side."""
    result = main_run(n_tokens, baseline, out, rounds, seed, repo)
    with atomic_file(out / "ingest.json") as f:
        json.dump(result, f, indent=2)
    lines = ["| format | tokens | baseline M tok/s | batches M tok/s | ratio |", "|---|---|---|---|---|"]
    for name, row in result["formats"].items():
        lines.append(f"| {name} | {row['tokens']} | {row['baseline']['median']:.2f} "
                     f"({row['baseline']['min']:.2f}-{row['baseline']['max']:.2f}) | {row['batches']['median']:.2f} "
                     f"({row['batches']['min']:.2f}-{row['batches']['max']:.2f}) | {row['speedup']:.1f}x |")
    click.echo("\n".join(lines))


if __name__ == "__main__":
    main()
