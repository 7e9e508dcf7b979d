"""pyproject.toml lists every package, so an installed wheel (not only an editable checkout) has them all."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    folders = {f"echospec.{top}": top for top in ("datastore", "retriever", "decoder", "tools")}
    assert config["package-dir"] == folders
    found = {f"echospec.{'.'.join(init.parent.relative_to(ROOT).parts)}"
             for top in folders.values() for init in (ROOT / top).rglob("__init__.py")}
    assert found == set(config["packages"])
