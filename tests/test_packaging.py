"""pyproject.toml lists every package that ships, so an installed wheel (not only an editable checkout) has them
all, and the developer benchmarks (tools/benchmarks) stay out of it: they run from a checkout."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).resolve().parents[1]
TOPS = ("datastore", "retriever", "decoder", "tools")
BENCHMARKS = "echospec.tools.benchmarks"


def test_every_package_but_the_benchmarks_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    assert config["package-dir"] == {f"echospec.{top}": top for top in TOPS}
    found = {f"echospec.{'.'.join(init.parent.relative_to(ROOT).parts)}"
             for top in TOPS for init in (ROOT / top).rglob("__init__.py")}
    assert BENCHMARKS in found  # the folder is there, in the checkout
    assert set(config["packages"]) == {p for p in found if not p.startswith(BENCHMARKS)}


def test_the_wheel_has_what_ships_and_no_benchmarks(tmp_path):
    source = tmp_path / "source"  # built from a copy: a build writes build/ and egg-info beside its source
    for top in TOPS:
        shutil.copytree(ROOT / top, source / top, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = "import sys; from setuptools import build_meta; build_meta.build_wheel(sys.argv[1])"
    subprocess.run([sys.executable, "-c", build, str(tmp_path / "dist")], cwd=source, check=True, capture_output=True)
    [wheel] = (tmp_path / "dist").glob("echospec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith("echospec/tools/benchmarks/")]
    assert {"echospec/tools/cli/__init__.py", "echospec/tools/bench/__init__.py", "echospec/retriever/kernels.py",
            "echospec/retriever/service/__init__.py", "echospec/tools/sample/corpus.jsonl"} <= set(names)
