"""Store and speaker names: one rule for the datastore, the service and the command line.

A name becomes part of a directory name and a URL path, so it is refused, never rewritten: 1 to 64
letters, digits, '_', '.' or '-', starting with a letter or digit, and no '..' (no slash, no
leading dot, no whitespace or control character)."""

from __future__ import annotations

import re

from .errors import DatastoreError

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
_NAME = re.compile(NAME_PATTERN)


def is_valid_name(name) -> bool:
    return isinstance(name, str) and _NAME.fullmatch(name) is not None and ".." not in name


def check_name(kind: str, name) -> str:
    """`name` when it is a valid name; DatastoreError saying the rule otherwise. `kind`: "store", "speaker"."""
    if not is_valid_name(name):
        shown = repr(name if not isinstance(name, str) or len(name) <= 70 else name[:64] + "...")
        raise DatastoreError(f"{kind} name {shown} must match {NAME_PATTERN} without '..'")
    return name
