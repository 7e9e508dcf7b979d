"""Where a build's tasks (see tasks.py) run: in this process, in local worker processes, or on Ray.

Both runners offer `partition(jobs)` (read the corpus units) and `run(jobs)` (build the stores); each
yields (key, result) pairs as tasks finish. Every job carries the memory its task needs: Ray reserves it
(a task waits for a node with that much free), the local runner starts no more processes than fit.
Ray is imported only here and only for `--ray`: it is the optional `ray` extra.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import multiprocessing

from .errors import CorpusError, DatastoreError
from .files import proc_bytes
from .tasks import partition_unit

Job = tuple[object, Callable, dict, int]  # key, task, keyword arguments, bytes of memory the task needs
DIED = ("a build task died (killed, or out of memory?); the finished shards are kept beside the target: "
        "run the same build again to resume")
RETRIES = 2  # Ray re-runs a task whose worker died this many times before the build fails


class LocalRunner:
    """Tasks in this process when one worker suffices, else in a pool of spawned processes (never forked:
    a forked child of a threaded parent can deadlock), no more at once than memory holds. The pool serves
    both phases of a build and closes with the runner: a spawned worker takes ~0.6 s to import the build."""

    def __init__(self, workers: int):
        self.workers = max(1, int(workers))
        self._pool: ProcessPoolExecutor | None = None

    def partition(self, jobs: list[Job]) -> Iterator[tuple[object, dict]]:
        return self.run(jobs)

    def run(self, jobs: list[Job]) -> Iterator[tuple[object, dict]]:
        if not jobs:
            return
        fit = max(1, available_memory() // max(memory for _, _, _, memory in jobs))
        workers = min(self.workers, len(jobs), fit)
        if workers == 1:
            for key, fn, kwargs, _ in jobs:
                yield key, fn(**kwargs)
            return
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=die_with_parent, initargs=(os.getpid(),))
        waiting, pending, finished = iter(jobs), {}, False
        try:
            for key, fn, kwargs, _ in itertools.islice(waiting, workers):  # at most `workers` tasks at once
                pending[self._pool.submit(fn, **kwargs)] = key
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    yield pending.pop(future), future.result()
                    for key, fn, kwargs, _ in itertools.islice(waiting, 1):
                        pending[self._pool.submit(fn, **kwargs)] = key
            finished = True
        except BrokenProcessPool:
            raise DatastoreError(DIED) from None
        finally:
            if not finished:  # a failed task, or the caller stopped: nothing more of this build runs
                self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def die_with_parent(parent: int) -> None:
    """In a worker process: be killed when the driver dies, however it dies (kill -9 included), so that no
    worker of a killed build lives on blocked on its pipe. Linux: the kernel's parent-death signal; elsewhere
    a thread that watches the parent."""
    try:
        asked = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):  # no prctl: not Linux
        asked = False
    if os.getppid() != parent:  # the driver died before this worker asked
        os._exit(1)
    if not asked:
        threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


_PR_SET_PDEATHSIG = 1


class RayRunner:
    """Tasks on a Ray cluster: Ray Data reads the corpus units, one Ray task builds each store."""

    def __init__(self, address: str):
        self.ray = import_ray()
        self.started = not self.ray.is_initialized()
        self.reaper = None
        if self.started:  # "auto": the cluster `ray start` left on this machine, else a new local one
            mark = f"{os.getpid()}-{uuid.uuid4().hex}"
            self.reaper = start_reaper(mark)
            os.environ[CLUSTER_MARK] = mark  # inherited by every process of a cluster that ray.init starts
            try:
                self.ray.init(address=None if address == "auto" else address, logging_level=logging.WARNING,
                              log_to_driver=False, configure_logging=True)
            finally:
                del os.environ[CLUSTER_MARK]
        import ray.data

        logging.getLogger("ray.data").setLevel(logging.ERROR)  # its notes on execution are not the user's
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # the build shows its own
        if hasattr(context, "issue_detectors_config"):
            context.issue_detectors_config.detectors = []

    def partition(self, jobs: list[Job]) -> Iterator[tuple[object, dict]]:
        if not jobs:
            return
        import ray.data

        items = [{"key": json.dumps(key), "job": json.dumps(kwargs)} for key, _, kwargs, _ in jobs]
        dataset = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            _partition_batch, batch_size=1, num_cpus=1, memory=max(m for *_, m in jobs))
        try:
            for row in dataset.iter_rows():
                stats = json.loads(row["stats"])
                if "error" in stats:
                    kind, message = stats["error"]
                    raise (CorpusError if kind == "CorpusError" else DatastoreError)(message)
                yield json.loads(row["key"]), stats
        except DatastoreError:
            raise
        except Exception as e:
            raise _library_error(e) from None

    def run(self, jobs: list[Job]) -> Iterator[tuple[object, dict]]:
        if not jobs:
            return
        largest = max(m for *_, m in jobs)
        offered = max((node["Resources"].get("memory", 0) for node in self.ray.nodes() if node["Alive"]), default=0)
        if largest > offered:
            raise DatastoreError(f"a task needs {largest / 2**30:.1f} GiB of memory but the largest Ray node "
                                 f"offers {offered / 2**30:.1f} GiB: use more shards")
        remote = {fn: self.ray.remote(fn) for _, fn, _, _ in jobs}
        pending = {remote[fn].options(num_cpus=1, memory=memory, max_retries=RETRIES).remote(**kwargs): key
                   for key, fn, kwargs, memory in jobs}
        try:
            while pending:
                done, _ = self.ray.wait(list(pending), num_returns=1)
                for ref in done:
                    key = pending.pop(ref)
                    try:
                        yield key, self.ray.get(ref)
                    except Exception as e:
                        raise _library_error(e) from None
        finally:
            for ref in pending:
                self.ray.cancel(ref, force=True)

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()
        if self.reaper is not None:  # it removes what shutdown left, then exits
            self.reaper.stdin.close()
            self.reaper.wait()


CLUSTER_MARK = "ECHOSPEC_RAY_CLUSTER"
"""Set in the environment of the processes of a cluster the build starts, for its reaper (reaper.py)."""


def start_reaper(mark: str) -> subprocess.Popen | None:
    """The reaper (reaper.py) for a cluster marked `mark`, on systems with /proc (elsewhere None: Ray's own ties
    only). Run by path in isolated mode (-I -S): it needs only the standard library and starts in milliseconds."""
    if not os.path.isdir("/proc"):
        return None
    return subprocess.Popen([sys.executable, "-I", "-S", str(Path(__file__).with_name("reaper.py")), CLUSTER_MARK,
                             mark, str(os.getpid())], stdin=subprocess.PIPE, start_new_session=True)


def _partition_batch(batch: dict) -> dict:
    """Ray Data's map over corpus units: one unit a batch. A bad corpus comes back as a row: Ray Data
    would pass the exception on as its own, with only the remote traceback's text."""
    stats = []
    for job in batch["job"]:
        try:
            stats.append(json.dumps(partition_unit(**json.loads(job))))
        except DatastoreError as e:
            stats.append(json.dumps({"error": [type(e).__name__, str(e)]}))
    return {"key": list(batch["key"]), "stats": stats}


def _library_error(error: BaseException) -> DatastoreError:
    """The echospec error a Ray task raised (Ray wraps it, with the remote traceback in its message), or
    the build's own message when the task failed otherwise (its worker died more than RETRIES times)."""
    seen = error
    while seen is not None:
        cause = getattr(seen, "cause", None) or seen.__cause__
        if isinstance(seen, DatastoreError) and not type(seen).__module__.startswith("ray"):
            return seen
        if isinstance(cause, DatastoreError) and not type(cause).__module__.startswith("ray"):
            return type(cause)(*cause.args)
        seen = cause
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return DatastoreError(f"{DIED} ({type(error).__name__}: {first_line})")


def import_ray():
    try:
        import ray
    except ImportError:
        raise DatastoreError("building on Ray needs the optional 'ray' extra: pip install -e '.[ray]' in a checkout") \
            from None
    return ray


def available_memory() -> int:
    """Bytes this machine can still give (MemAvailable), or a generous guess where /proc is absent."""
    available = proc_bytes("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
