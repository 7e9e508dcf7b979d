"""Making written files durable before they are renamed into place."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Make everything under `root` durable before it is renamed into place."""
    if _syncfs(root):
        return
    for path in sorted(root.rglob("*"), reverse=True):
        if path.is_file():
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
        else:
            fsync_dir(path)
    fsync_dir(root)


def _syncfs(path: Path) -> bool:
    """Linux syncfs(2): one call instead of one fsync per file (a store has 3 files per speaker;
    at ~4 ms an fsync, per-file syncing cost more than sorting a 1M-token corpus)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY)
    except (OSError, AttributeError):
        return False
    try:
        return getattr(libc, "syncfs", None) is not None and libc.syncfs(fd) == 0
    finally:
        os.close(fd)
