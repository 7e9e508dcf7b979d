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


# Runs every example in order in one interpreter: each Python block in a fresh namespace (importing torch and
# transformers once, not once a block, halves the test's time), each shell block in bash.
RUNNER = """
import subprocess, sys, traceback
sys.path.insert(0, sys.argv[1])
from test_readme import examples
for number, (kind, code) in enumerate(examples(), 1):
    try:
        if kind == "python":
            exec(compile(code, f"README example {number}", "exec"), {"__name__": "__main__"})
        else:
            subprocess.run(["bash", "-euo", "pipefail", "-c", code], check=True)
    except BaseException:
        print(f"README example {number} ({kind}) failed:\\n{code}", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


@pytest.mark.slow
def test_readme_examples_run(tmp_path):
    (tmp_path / "tools").symlink_to(ROOT / "tools")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, "-c", RUNNER, str(ROOT / "tests")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
