"""The one record of the machine a measurement ran on, for every benchmark's results file."""

from __future__ import annotations

import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version

LIBRARIES = ("numpy", "numba", "faiss", "torch", "transformers", "vllm")
"""Reported with their versions when the measuring process has imported them (nothing is imported to ask)."""


def machine(**details) -> dict:
    """The CPU, its cores, the load when asked, the platform, Python and the libraries imported so far, with
    `details` (threads, device, dtype, ...) that the benchmark sets."""
    record = {"cpu": cpu_name(), "cores": os.cpu_count(), "load_average": list(os.getloadavg()),
              "platform": platform.platform(), "python": platform.python_version()}
    for name in LIBRARIES:
        module = sys.modules.get(name)
        if module is not None:
            record[name] = getattr(module, "__version__", None) or installed_version(name)
    return record | details


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def installed_version(name: str) -> str | None:
    """An installed distribution's version, None where it is not installed."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None
