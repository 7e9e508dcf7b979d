"""The README's examples run as written: every fenced block preceded by `<!-- example -->`.

Each block is self-contained; they run in order in one scratch directory (where `tools/sample` is the
repository's), so a block may use files an earlier one wrote; shell blocks use this interpreter's `echospec`.
"""

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from echospec.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- example -->\s*\n```(python|bash)\n(.*?)```", re.S)
COMMAND_ROW = re.compile(r"^\| `echospec ([a-z-]+)[^`]*` \| `(echospec\.[\w.]+)\(", re.M)


def examples():
    return BLOCK.findall((ROOT / "README.md").read_text(encoding="utf-8"))


def test_readme_has_examples_of_each_kind():
    kinds = {kind for kind, _ in examples()}
    assert kinds == {"python", "bash"}


def test_command_table_names_real_commands_and_library_calls():
    rows = COMMAND_ROW.findall((ROOT / "README.md").read_text(encoding="utf-8"))
    assert {command for command, _ in rows} == set(main.commands)
    for command, call in rows:
        module, _, name = call.rpartition(".")
        assert callable(getattr(importlib.import_module(module), name)), f"echospec {command}: {call}"


@pytest.mark.slow
def test_readme_examples_run(tmp_path):
    (tmp_path / "tools").symlink_to(ROOT / "tools")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for number, (kind, code) in enumerate(examples(), 1):
        if kind == "python":
            command = [sys.executable, "-c", code]
        else:
            command = ["bash", "-euo", "pipefail", "-c", code]
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"README example {number} ({kind}) failed:\n{code}\n{done.stdout}\n{done.stderr}"
