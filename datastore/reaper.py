"""Beside a build that starts its own local Ray cluster: when the driver is gone, however it died (kill -9
included), kill every process of that cluster, within a second.

    python reaper.py NAME MARK DRIVER_PID    # stdin: a pipe from the driver; run by path, it imports no echospec

Ray ties its head processes (gcs_server, raylet, the dashboard, the monitors) to the driver with the kernel's
parent-death signal, and its workers die with the raylet; but the dashboard and runtime-env agents the raylet
starts only poll for it (5 checks 0.4 s apart), then report to the dead GCS: they outlived a killed driver by
minutes. Nor can they be found by the mark the cluster's processes inherit in their environment (NAME=MARK, set
while ray.init starts the cluster): setproctitle ("ray::DashboardAgent") overwrites /proc/PID/environ. So while
the driver lives the reaper follows the cluster's process tree: a process carrying the mark, and every
descendant of one, is a member. Every POLL seconds is soon enough: a process's mark is still readable until it
sets its title, after it has imported Ray (seconds). When the driver closes the pipe (it ends, or the kernel
closes it with the driver), the members are stopped (SIGSTOP: a stopped process starts no other), their children
found, and all killed.
"""

import os
import select
import signal
import sys

POLL = 0.25


class Cluster:
    """The processes of one marked cluster, by pid and start time (a pid reused since is no member)."""

    def __init__(self, mark: bytes, driver: int):
        self.mark, self.driver, self.ignored = mark, driver, {driver, os.getpid()}
        self.members: dict[int, str] = {}
        # processes seen that are not members, their environment read once; not the driver's children: one
        # forked but not yet running its program still has the driver's environment, without the mark
        self.strangers: set[tuple[int, str]] = set()

    def scan(self) -> dict[int, str]:
        """Add the members started since the last scan; forget those that ended; return the members."""
        table = processes()
        self.members = {pid: start for pid, start in self.members.items() if table.get(pid, (0, ""))[1] == start}
        self.strangers &= {(pid, start) for pid, (_, start) in table.items()}
        added = True
        while added:  # until every descendant of a member is one (a child may be listed before its parent)
            added = False
            for pid, (parent, start) in table.items():
                if pid in self.members or pid in self.ignored:
                    continue
                if parent in self.members or ((pid, start) not in self.strangers and self.marked(pid)):
                    self.members[pid] = start
                    added = True
                elif parent != self.driver:
                    self.strangers.add((pid, start))
        return self.members

    def marked(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                return self.mark in f.read().split(b"\0")
        except OSError:  # ended, or not ours
            return False

    def kill(self) -> None:
        """Stop every member (and the children they started meanwhile), then kill them all."""
        stopped: set[int] = set()
        while True:
            fresh = set(self.scan()) - stopped
            if not fresh:
                break
            signal_all(fresh, signal.SIGSTOP)
            stopped |= fresh
        signal_all(stopped, signal.SIGKILL)


def processes() -> dict[int, tuple[int, str]]:
    """Every live process: pid -> (parent pid, start time in clock ticks); zombies left out."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()  # the name before ")" may hold spaces
            except OSError:
                continue
            if fields[0] != b"Z":
                table[int(entry)] = (int(fields[1]), fields[19].decode())
    return table


def signal_all(pids, signum) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except OSError:  # ended meanwhile
            pass


def main(name: str, mark: str, driver: int) -> None:
    cluster = Cluster(f"{name}={mark}".encode(), driver)
    while True:
        ready, _, _ = select.select([sys.stdin.buffer], [], [], POLL)
        if ready and not os.read(sys.stdin.fileno(), 1 << 12):  # closed: the driver ended or died
            break
        cluster.scan()
    cluster.kill()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
