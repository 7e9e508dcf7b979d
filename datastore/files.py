"""Writing so that nothing half-written is ever seen: write beside the target, fsync, rename, fsync the folder.

The one way the project replaces a file or a directory: the datastore's stores, and the tools' reports,
corpora, tokenizers and checkpoints. A crash at any point leaves the old version or the new one, never a mix.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path

SHARED_FILE_MODE = 0o644
SHARED_DIR_MODE = 0o755
"""mkstemp and mkdtemp make 0600 and 0700; what is written here is shipped and shared, so readable by all."""


@contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w"):
    """Yield a temporary file beside `path`; when the block ends without error, fsync it, rename it over
    `path` and fsync the folder. On an error the temporary file is removed and `path` is untouched."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, SHARED_FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextmanager
def atomic_dir(path: str | os.PathLike):
    """Yield an empty temporary directory beside `path`; when the block ends without error, make everything
    in it durable and swap it in for `path` (an existing `path` is replaced whole). On an error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        os.chmod(tmp, SHARED_DIR_MODE)
        yield tmp
        fsync_tree(tmp)
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(tmp: Path, target: Path) -> None:
    """Rename the finished directory `tmp` to `target`; an existing target is moved aside first and removed
    once the new one is in place (a rename cannot replace a non-empty directory)."""
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(target, old)
    os.rename(tmp, target)
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
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
