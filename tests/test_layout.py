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


def _echospec_imports(path: Path, names: bool = False) -> set[str]:
    """The echospec modules a file imports, as absolute names (echospec.tools.cli.store, ...); with `names`, each
    name imported from one too (echospec.retriever.kernels for `from ...retriever import kernels`)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = ["echospec", *parts[:-1]]  # a module's package; an __init__'s is its own folder, the same list
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else []))
            found |= {module} | ({f"{module}.{a.name}" for a in node.names} if names else set())
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {name for name in found if name.startswith("echospec.")}


# retriever/'s rooms -> the rooms of it each may import: the core (the package's own modules) serves them all; the
# HTTP client is one room, the service another and the engine adapters a third, none importing a sibling's code but
# the client's (the wire format the service answers in; the RemoteRetriever an engine may draft from)
RETRIEVER_ROOMS = {"core": {"core"}, "client": {"core", "client"}, "service": {"core", "client", "service"},
                   "engines": {"core", "client", "engines"}}
DOCUMENTED_PATHS = {"retriever/remote.py": "client", "retriever/vllm_proposer.py": "engines"}  # re-exports


def _retriever_room(parts: tuple[str, ...]) -> str:
    return parts[0] if len(parts) > 1 and parts[0] in RETRIEVER_ROOMS else "core"


def test_retriever_rooms_import_only_what_they_may():
    wrong = {}
    for path in (ROOT / "retriever").rglob("*.py"):
        name = str(path.relative_to(ROOT))
        room = DOCUMENTED_PATHS.get(name) or _retriever_room(path.relative_to(ROOT / "retriever").parts)
        used = {_retriever_room(tuple(n.split(".")[2:]) + ("",)) for n in _echospec_imports(path)
                if n.startswith("echospec.retriever")}
        if used - RETRIEVER_ROOMS[room]:
            wrong[name] = sorted(used - RETRIEVER_ROOMS[room])
    assert wrong == {}
    assert set(DOCUMENTED_PATHS) <= {str(p.relative_to(ROOT)) for p in (ROOT / "retriever").glob("*.py")}


# the service's layers, bottom up: its ASGI helpers know no app, the app no start-up (start.py runs it on uvicorn)
SERVICE_LAYERS = {"asgi": set(), "app": {"asgi"}, "start": {"app"}}


def test_the_service_layers_import_downwards_only():
    service = ROOT / "retriever" / "service"
    used = {layer: {n.rsplit(".", 1)[-1] for n in _echospec_imports(service / f"{layer}.py", names=True)
                    if n.rsplit(".", 1)[-1] in SERVICE_LAYERS} for layer in SERVICE_LAYERS}
    assert {layer: names - SERVICE_LAYERS[layer] for layer, names in used.items() if names - SERVICE_LAYERS[layer]} == {}
    assert used["app"] == {"asgi"}  # the parse sees them


def test_outside_the_retriever_the_kernels_are_reached_through_the_replay_seam_alone():
    # retriever/replay.py names the kernels that scripts replaying a proposal may call; the rest stay private
    outside = [p for folder in ("datastore", "decoder", "tools") for p in (ROOT / folder).rglob("*.py")]
    assert [str(p.relative_to(ROOT)) for p in outside
            if "echospec.retriever.kernels" in _echospec_imports(p, names=True)] == []
    assert any("echospec.retriever.replay" in _echospec_imports(p, names=True) for p in outside)  # the parse sees it


def _indexed(module) -> set[str]:
    return {line.split()[0] for line in module.__doc__.splitlines() if line.startswith("    ") and line[4] != " "}


def test_the_benchmarks_index_lists_every_benchmark_and_support_every_helper():
    import echospec.tools.benchmarks as benchmarks
    import echospec.tools.benchmarks.support as support

    folder = ROOT / "tools" / "benchmarks"
    assert _indexed(benchmarks) == {p.stem for p in folder.glob("*.py")} - {"__init__"}
    assert _indexed(support) == {p.stem for p in (folder / "support").glob("*.py")} - {"__init__"}
    # the helpers stand under the benchmarks, never on one
    assert {str(p.relative_to(ROOT)) for p in (folder / "support").glob("*.py")
            if any(n.startswith("echospec.tools.benchmarks.") and ".support" not in n for n in _echospec_imports(p))} == set()


def test_no_module_is_over_500_lines_but_the_kernels():
    # numba's cache is per file, so the kernels that call each other stay in one (retriever/kernels.py)
    modules = [p for folder in MAY_IMPORT for p in (ROOT / folder).rglob("*.py")]
    assert {str(p.relative_to(ROOT)): n for p in modules
            if (n := len(p.read_text().splitlines())) > 500 and p != ROOT / "retriever" / "kernels.py"} == {}


def test_developer_benchmarks_stand_apart_from_what_ships():
    # the benchmarks use the library and tools/commands.py, never the CLI's modules; nothing that ships
    # imports a benchmark, so they can leave the wheel
    benchmarks = sorted((ROOT / "tools" / "benchmarks").rglob("*.py"))
    assert {str(p.relative_to(ROOT)): sorted(n for n in _echospec_imports(p) if n.startswith("echospec.tools.cli"))
            for p in benchmarks if any(n.startswith("echospec.tools.cli") for n in _echospec_imports(p))} == {}
    shipped = [p for folder in MAY_IMPORT for p in (ROOT / folder).rglob("*.py") if "benchmarks" not in p.parts]
    assert [str(p.relative_to(ROOT)) for p in shipped
            if any(n.startswith("echospec.tools.benchmarks") for n in _echospec_imports(p))] == []
    assert any(n == "echospec.tools.commands" for p in benchmarks for n in _echospec_imports(p))  # the parse sees them
