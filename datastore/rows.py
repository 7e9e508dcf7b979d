"""A build's catalog with its utterance rows, written by a process of its own while the stores build.

The rows are known once the corpus is read (the partition tasks' meta files) and no store task waits on
them, yet writing them took 10 s of a 199M-token build's 87 (2.24M rows) when the driver wrote them after
the stores. A thread beside the tasks shares their GIL (at 25M tokens it slowed the tasks' Python and NumPy
steps by as much as it saved), and a spawned multiprocessing worker would run the caller's main module
again, so RowsProcess runs this module (builds of fewer than ROWS_APART utterances write_catalog in the
driver after the stores: the process takes ~1.5 s to start, about what 250k rows take to write):

    python -m echospec.datastore.rows REQUEST.json    # prints {"per_speaker": [[name, n], ...], "seconds": ...}

The build's phases (`info()["build_phases"]`) keep the rows' seconds, and catalog_rows_apart = 1 when they
were written apart. The process writes how many rows it has inserted to catalog-rows.progress after each partition
file, for the build's progress bar once the stores are done and the rows are not (minutes at billions of tokens).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from . import catalog
from .errors import DatastoreError
from .runners import die_with_parent
from .tasks import unpack_strings

ROWS_APART = 250_000


class RowsProcess:
    """`catalog.create(root, meta)` and every utterance's row, in a child process; `result` waits for it."""

    def __init__(self, root: Path, meta: dict, work: Path, units: list[dict]):
        self.work, self.rows = work, sum(u["utterances"] for u in units)
        request = work / "catalog-rows.json"
        request.write_text(json.dumps({"root": str(root), "meta": meta, "work": str(work), "units": units,
                                       "parent": os.getpid()}))
        # the child imports what this process imports, also from paths a script added to sys.path itself
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        with open(work / "catalog-rows.out", "wb") as out, open(work / "catalog-rows.err", "wb") as err:
            self.process = subprocess.Popen([sys.executable, "-m", __name__, str(request)], stdout=out, stderr=err,
                                            env=env)

    def result(self, progress: bool = False) -> tuple[Counter, dict]:
        """Utterances per speaker, and the process's wall and CPU seconds; waits with a bar when `progress`."""
        with tqdm(total=self.rows, initial=self._written(0), desc="writing catalog rows", unit=" rows",
                  unit_scale=True, leave=False, disable=not progress) as bar:
            while True:
                try:
                    returncode = self.process.wait(timeout=0.25)
                    break
                except subprocess.TimeoutExpired:
                    bar.update(self._written(bar.n) - bar.n)
            bar.update(self._written(bar.n) - bar.n)
            bar.refresh()
        if returncode != 0:
            lines = (self.work / "catalog-rows.err").read_text(errors="replace").strip().splitlines()
            raise DatastoreError(f"writing the catalog's utterance rows failed: {lines[-1] if lines else 'killed'}")
        done = json.loads((self.work / "catalog-rows.out").read_text())
        return Counter({name: n for name, n in done["per_speaker"]}), done["seconds"]

    def _written(self, known: int) -> int:
        try:
            return int((self.work / "catalog-rows.progress").read_text())
        except (OSError, ValueError):  # not written yet, or caught mid-write
            return known

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def insert_partition_rows(db, work: Path, units: list[dict], written: Callable[[int], None] | None = None) -> Counter:
    """The utterances' catalog rows, in corpus order, from the partition tasks' meta files, a file's rows
    at once in one transaction (`written(rows so far)` after each file); returns utterances per speaker."""
    per_speaker: Counter = Counter()
    rows = 0
    with db.atomic():
        for unit in units:
            directory = work / "parts" / f"unit-{unit['unit']:06d}"
            for name in sorted(n for n in unit["files"] if n.endswith(".meta.npz")):
                with np.load(directory / name, allow_pickle=False) as data:
                    ids, speakers, sources, extras = (unpack_strings(data, key)
                                                      for key in ("ids", "speakers", "sources", "extras"))
                    tokens = data["tokens"].tolist()
                speakers = [s or None for s in speakers]
                per_speaker.update(speakers)
                catalog.add_utterances(db, zip(ids, speakers, tokens, sources, [e or None for e in extras]))
                rows += len(ids)
                if written:
                    written(rows)
    return per_speaker


def write_catalog(root: Path, meta: dict, work: Path, units: list[dict],
                  written: Callable[[int], None] | None = None) -> tuple[Counter, dict]:
    """catalog.create in `root` with every utterance's row; returns utterances per speaker and the seconds."""
    started, cpu = time.perf_counter(), time.process_time()
    db = catalog.create(root, meta)
    try:
        per_speaker = insert_partition_rows(db, work, units, written)
        catalog.index_utterances(db)
    finally:
        db.conn.close()
    return per_speaker, {"catalog_rows": round(time.perf_counter() - started, 3),
                         "catalog_rows_cpu": round(time.process_time() - cpu, 3)}


def main(request: str) -> None:
    asked = json.loads(Path(request).read_text())
    die_with_parent(asked["parent"])
    work = Path(asked["work"])
    progress = work / "catalog-rows.progress"
    per_speaker, seconds = write_catalog(Path(asked["root"]), asked["meta"], work, asked["units"],
                                         lambda rows: progress.write_text(str(rows)))
    json.dump({"per_speaker": list(per_speaker.items()), "seconds": {**seconds, "catalog_rows_apart": 1}},
              sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
