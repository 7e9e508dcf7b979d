"""The README's and docs/*.md's examples run as written: every fenced block preceded by `<!-- example -->`.

Each document's examples run in order in a scratch folder of their own, as a reader runs them (the README's
quick tour: `cd "$(mktemp -d)"`, `$SAMPLE` the shipped sample): a block may use files an earlier block of the
same document wrote, never another document's, and nothing is written into the checkout. Shell blocks use this
interpreter's `echospec`.
"""

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from echospec.tools.cli import main
from echospec.tools.corpus import SAMPLE_DIR

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"<!-- example -->\s*\n```(python|bash)\n(.*?)```", re.S)
COMMAND_ROW = re.compile(r"^\| `echospec ([a-z-]+)[^`]*` \| `(echospec\.[\w.]+)\(", re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#+ (.+)$", re.M)


def examples(path: Path) -> list[tuple[str, str]]:
    return BLOCK.findall(path.read_text(encoding="utf-8"))


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_examples_of_each_kind_in_the_readme_and_the_docs():
    assert {kind for kind, _ in examples(ROOT / "README.md")} == {"python", "bash"}
    assert {kind for doc in DOCUMENTS[1:] for kind, _ in examples(doc)} == {"python", "bash"}


def test_command_table_names_real_commands_and_library_calls():
    rows = COMMAND_ROW.findall((ROOT / "README.md").read_text(encoding="utf-8"))
    assert {command for command, _ in rows} == set(main.commands)
    for command, call in rows:
        module, _, name = call.rpartition(".")
        assert callable(getattr(importlib.import_module(module), name)), f"echospec {command}: {call}"


def test_the_vllm_guide_states_each_relaxed_rules_defaults():
    from echospec.decoder.vllm_acceptance import POLICIES, read_rule

    rows = re.findall(r"^\| `(\w+)` \| ((?:`\w+` \([\d.]+\)(?:, )?)+) \|", (ROOT / "docs" / "vllm.md").read_text(),
                      re.M)
    assert {policy for policy, _ in rows} == set(POLICIES)
    for policy, options in rows:
        stated = {name: float(value) for name, value in re.findall(r"`(\w+)` \(([\d.]+)\)", options)}
        assert stated == read_rule({"echospec": {"policy": policy}}).options, f"docs/vllm.md, {policy}"


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda doc: doc.name)
def test_links_name_files_and_headings_that_exist(doc):
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if "://" in target:
            continue
        path, _, fragment = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        assert linked.exists(), f"{doc.name}: link to {target}: no such file"
        if fragment:
            anchors = {anchor(h) for h in HEADING.findall(linked.read_text(encoding="utf-8"))}
            assert fragment in anchors, f"{doc.name}: link to {target}: no such heading in {linked.name}"


# Runs every document's examples in order in one interpreter: each Python block in a fresh namespace (importing
# torch and transformers once, not once a block, halves the test's time), each shell block in bash.
RUNNER = """
import os, subprocess, sys, traceback
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from test_readme import DOCUMENTS, examples
for doc in DOCUMENTS:
    scratch = Path(sys.argv[2]) / doc.stem
    scratch.mkdir()
    os.chdir(scratch)
    for number, (kind, code) in enumerate(examples(doc), 1):
        try:
            if kind == "python":
                exec(compile(code, f"{doc.name} example {number}", "exec"), {"__name__": "__main__"})
            else:
                subprocess.run(["bash", "-euo", "pipefail", "-c", code], check=True)
        except BaseException:
            print(f"{doc.name} example {number} ({kind}) failed:\\n{code}", file=sys.stderr)
            traceback.print_exc()
            sys.exit(1)
"""


@pytest.mark.slow
def test_examples_run(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               SAMPLE=str(SAMPLE_DIR), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, "-c", RUNNER, str(ROOT / "tests"), str(tmp_path)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout + done.stderr
