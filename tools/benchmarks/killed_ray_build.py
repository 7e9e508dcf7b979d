"""How long the processes of a Ray build outlive its driver when it is killed (SIGKILL): the time to clean.

    python -m echospec.tools.benchmarks.killed_ray_build --at 2 5 8 shard --runs 3

Each run builds a small corpus with one 800k-token utterance (2 shards, ray='auto': the build starts its own local
Ray cluster) in a child process, and kills it `--at` seconds after it started, or, for "shard", once a shard task
runs and Ray's agents are up (the issue 48 case). While the driver lives, every process it starts is followed as a
tree (and by a marker in its environment, for one whose parent died first); after the kill each is timed until it
ends. Prints the machine (tools/bench/machine.py), then one line a run: the kill point, the processes then running,
the seconds until the last ended (or those still running after `--wait` seconds, which are then killed), and the
load average, which the figure depends on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from echospec.datastore.reaper import processes
from echospec.tools.bench.machine import machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--at", nargs="+", default=["shard"], help="seconds after the start, or 'shard'")
    parser.add_argument("--runs", type=int, default=1, help="runs at each kill point")
    parser.add_argument("--wait", type=float, default=30.0, help="seconds to wait for the processes to end")
    args = parser.parse_args()
    print(json.dumps(machine()))
    for at in args.at:
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="killed-ray-build-") as tmp:
                print(run(Path(tmp), at, args.wait), flush=True)


def run(tmp: Path, at: str, wait: float) -> str:
    script = write_build(tmp)
    mark = f"ECHOSPEC_KILLED_BUILD={tmp.name}".encode()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update([mark.decode().split("=")])
    load = os.getloadavg()[0]
    started, driver, known = time.monotonic(), subprocess.Popen([sys.executable, str(script)], env=env), {}
    running = follow(driver.pid, mark, known)
    while not kill_now(tmp, at, started, running):
        if driver.poll() is not None:
            return f"at {at}: the build ended ({driver.returncode}) before it could be killed"
        time.sleep(0.05)
        running = follow(driver.pid, mark, known)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    killed = time.monotonic()
    while follow(driver.pid, mark, known) and time.monotonic() < killed + wait:
        time.sleep(0.02)
    left = follow(driver.pid, mark, known)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(tmp, ignore_errors=True)
    outcome = f"{len(left)} still running after {wait:.0f} s: {sorted(left.values())}" if left else \
        f"all ended {time.monotonic() - killed:.2f} s after the kill"
    return (f"at {at}: killed {killed - started:.1f} s in, {len(running)} processes running "
            f"({sum(name.startswith('ray::') for name in running.values())} titled ray::); {outcome}; "
            f"load average {load:.1f}")


def write_build(tmp: Path) -> Path:
    rng = np.random.default_rng(1)
    small = [rng.integers(0, 2000, 50) for _ in range(60)]
    big = rng.integers(0, 2000, 800_000)
    tokens = np.concatenate(small + [big])
    np.savez(tmp / "corpus.npz", tokens=tokens, lengths=np.array([len(t) for t in small] + [len(big)]))
    script = tmp / "build.py"
    script.write_text("from echospec.datastore import build\n"
                      f"build({str(tmp / 'corpus.npz')!r}, {str(tmp / 'store')!r}, shards=2, ray='auto', "
                      "per_speaker=False, faiss=False, progress=False)\n")
    return script


def kill_now(tmp: Path, at: str, started: float, running: dict) -> bool:
    if at != "shard":
        return time.monotonic() - started >= float(at)
    return bool(list(tmp.glob(".store.work-*/shards/*/task.json"))) and any(
        name.startswith("ray::DashboardAgent") for name in running.values())


def follow(driver: int, mark: bytes, known: dict) -> dict:
    """Add to `known` ((pid, start time) -> command line) the processes the driver started: its descendants and
    those carrying `mark`; return those running (pid -> command line)."""
    table = processes()
    members = {pid for pid, (parent, start) in table.items() if (pid, start) in known or parent == driver
               or marked(pid, mark)}
    added = True
    while added:
        fresh = {pid for pid, (parent, _) in table.items() if parent in members and pid not in members}
        members |= fresh
        added = bool(fresh)
    for pid in members:
        known.setdefault((pid, table[pid][1]), command_line(pid))
    return {pid: command_line(pid) for pid in members}


def marked(pid: int, mark: bytes) -> bool:
    try:
        return mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:80].strip()
    except OSError:
        return "(ended)"


if __name__ == "__main__":
    main()
