"""Import rules of the layout (README "Layout"): each folder imports only what its room may."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the folder -> the echospec packages it may import
MAY_IMPORT = {
    "datastore": set(),
    "retriever": {"datastore"},
    "decoder": {"retriever"},
    "tools": {"datastore", "retriever", "decoder"},
}


def _imported_packages(path: Path, folder: str) -> set[str]:
    """echospec packages (datastore, retriever, decoder, tools) a module imports, absolute or relative."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").startswith("echospec."):
                found.add(node.module.split(".")[1])
            elif node.level >= 2:  # from ..x import y: x is another top-level package (from a package's module)
                depth = len(path.relative_to(ROOT / folder).parts)  # 1: a module of the folder itself
                if node.level == depth + 1 and node.module:
                    found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("echospec.")}
    return found - {folder}


@pytest.mark.parametrize("folder", sorted(MAY_IMPORT))
def test_folders_import_only_what_their_room_may(folder):
    wrong = {str(p.relative_to(ROOT)): sorted(_imported_packages(p, folder) - MAY_IMPORT[folder])
             for p in (ROOT / folder).rglob("*.py")}
    assert not {k: v for k, v in wrong.items() if v}


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_retriever_and_datastore_load_no_torch_and_no_web_framework(tmp_path):
    modules = _modules_after("import echospec.datastore, echospec.retriever\n"
                             "from echospec.retriever import Retriever, CandidateTree, RemoteRetriever")
    assert "echospec.retriever.retriever" in modules  # the import really happened
    assert not modules & {"torch", "transformers", "fastapi", "uvicorn", "starlette", "prometheus_client"}


def test_the_tree_contract_stands_alone():
    modules = _modules_after("import echospec.retriever.tree")
    assert "echospec.retriever.tree" in modules
    assert not {m for m in modules if m.startswith(("echospec.datastore", "sqlite_utils", "faiss", "torch"))}


def test_the_acceptance_rules_load_no_numba():
    # vLLM's plugin (decoder/vllm_acceptance.py) loads them in engines where numba must not be loaded at start
    modules = _modules_after("import echospec.decoder.policies, echospec.decoder.vllm_acceptance")
    assert "echospec.decoder.policies" in modules
    assert not {m for m in modules if m.startswith(("numba", "echospec.retriever", "echospec.datastore", "vllm"))}


def _echospec_imports(path: Path) -> set[str]:
    """The echospec modules a file imports, as absolute names (echospec.tools.cli.store, ...)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = ["echospec", *parts[:-1]]  # a module's package; an __init__'s is its own folder, the same list
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            found.add(".".join(base + (node.module.split(".") if node.module else [])))
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {name for name in found if name.startswith("echospec.")}


def test_developer_benchmarks_stand_apart_from_what_ships():
    # the benchmarks use the library and tools/commands.py, never the CLI's modules; nothing that ships
    # imports a benchmark, so they can leave the wheel
    benchmarks = sorted((ROOT / "tools" / "benchmarks").glob("*.py"))
    assert {str(p.relative_to(ROOT)): sorted(n for n in _echospec_imports(p) if n.startswith("echospec.tools.cli"))
            for p in benchmarks if any(n.startswith("echospec.tools.cli") for n in _echospec_imports(p))} == {}
    shipped = [p for folder in MAY_IMPORT for p in (ROOT / folder).rglob("*.py") if "benchmarks" not in p.parts]
    assert [str(p.relative_to(ROOT)) for p in shipped
            if any(n.startswith("echospec.tools.benchmarks") for n in _echospec_imports(p))] == []
    assert any(n == "echospec.tools.commands" for p in benchmarks for n in _echospec_imports(p))  # the parse sees them
