"""Writing so that nothing half-written is ever seen: write beside the target, fsync, rename, fsync the folder.

The one way the project replaces a file or a directory: the datastore's stores, and the tools' reports,
corpora, tokenizers and checkpoints. A crash at any point leaves the old version or the new one, never a mix.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import shutil
import signal
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
def atomic_dir(path: str | os.PathLike, tag: str = "tmp", replace: bool = True):
    """Yield an empty temporary directory beside `path` (`.NAME.TAG-PID-XXXXXXXX`: `remove_abandoned` finds
    those of killed processes); when the block ends without error, make everything in it durable and swap it
    in for `path`: an existing `path` is replaced whole, or with `replace=False` kept (another attempt at the
    same work finished first) and this one removed. On an error the temporary directory is removed.

    The one way the project writes a directory: datastores, their speaker stores, a build's finished tasks,
    and the tools' checkpoints."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.{tag}-{os.getpid()}-"))
    try:
        os.chmod(tmp, SHARED_DIR_MODE)
        yield tmp
        fsync_tree(tmp)
        if replace:
            replace_dir(tmp, path)
        else:
            _rename_unless_present(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _rename_unless_present(tmp: Path, path: Path) -> None:
    try:
        os.rename(tmp, path)
    except OSError:
        if not path.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(path.parent)


def remove_abandoned(path: Path, tag: str = "tmp") -> None:
    """Delete the temporary directories `atomic_dir(path, tag)` left in processes that are gone (killed)."""
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.{tag}-*"):
        pid = tmp.name.rsplit("-", 2)[-2]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(tmp: Path, target: Path) -> None:
    """Rename the finished directory `tmp` to `target`, atomically at every instant where the system allows:
    an existing target is exchanged with `tmp` in one system call (Linux renameat2(RENAME_EXCHANGE), macOS
    renamex_np(RENAME_SWAP)) and the old directory, now at `tmp`, removed. Elsewhere the target is moved aside
    to `.NAME.old-PID-*` first (a rename cannot replace a non-empty directory): a crash between the two renames
    leaves no directory at `target`, and `recover_dir` moves the old one back."""
    if target.exists() and _exchange(tmp, target):
        crash_point("replace_dir:exchanged")
        fsync_dir(target.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(target, old)
        crash_point("replace_dir:moved-aside")
    os.rename(tmp, target)
    crash_point("replace_dir:renamed")
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def recover_dir(target: Path) -> None:
    """Finish what a killed `replace_dir` of `target` left: with no directory at `target`, move the old one
    back from `.NAME.old-PID-*`; with one, delete the old copies. Copies of a process still running are left
    alone (it is between its renames)."""
    for old in sorted(target.parent.glob(f".{target.name}.old-*")):
        pid = old.name.rsplit("-", 2)[-2]
        if pid.isdigit() and process_alive(int(pid)):
            continue
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(old, target)
            fsync_dir(target.parent)


def crash_point(name: str) -> None:
    """Test hook: SIGKILL this process here if ECHOSPEC_CRASH_AT names this point (tests/datastore/test_faults.py kills
    builds and enrollments at each of their renames this way). Costs one environment look-up."""
    if os.environ.get("ECHOSPEC_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one system call; False where the system or file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    if hasattr(libc, "renameat2"):  # Linux (glibc >= 2.28, musl)
        result = libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    elif hasattr(libc, "renamex_np"):  # macOS
        result = libc.renamex_np(os.fsencode(a), os.fsencode(b), _RENAME_SWAP)
    else:
        return False
    if result == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):  # file system cannot: fall back
        return False
    raise OSError(error, os.strerror(error), str(a), None, str(b))


_AT_FDCWD, _RENAME_EXCHANGE, _RENAME_SWAP = -100, 2, 2


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def proc_bytes(path: str, field: str) -> int | None:
    """A "Field:  N kB" line of a Linux /proc file (/proc/meminfo, /proc/self/status) in bytes; None where the
    file or the field is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


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
