"""Writing files so that nothing half-written is ever seen: a temporary file beside the target, fsync, rename."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w"):
    """Yield a temporary file beside `path`; when the block ends without error, fsync it and rename it over `path`.

    The file is made readable by all (mkstemp makes it 0600): what tools write is shipped and shared.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
