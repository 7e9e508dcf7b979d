"""The README's examples run as written: every fenced block preceded by `<!-- example -->`.

Each block is self-contained; they run in order in one scratch directory (where `tools/sample` is the
repository's), so a block may use files an earlier one wrote; shell blocks use this interpreter's `echospec`.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- example -->\s*\n```(python|bash)\n(.*?)```", re.S)


def examples():
    return BLOCK.findall((ROOT / "README.md").read_text(encoding="utf-8"))


def test_readme_has_examples_of_each_kind():
    kinds = {kind for kind, _ in examples()}
    assert kinds == {"python", "bash"}


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
