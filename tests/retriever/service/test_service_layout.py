"""The service's room: the web framework stays inside retriever/service/, and uvicorn's protocol
classes (private) inside fast_http.py, the one module written for a given uvicorn version."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
WEB = ("fastapi", "starlette", "uvicorn", "prometheus_client", "pydantic", "uvloop")


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def test_only_the_service_imports_a_web_framework():
    outside = [p for p in (ROOT / "retriever").rglob("*.py") if "service" not in p.relative_to(ROOT).parts]
    assert outside, "no retriever modules found"
    wrong = {str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p) if m.split(".")[0] in WEB)
             for p in outside}
    assert not {k: v for k, v in wrong.items() if v}


def test_only_fast_http_imports_uvicorns_protocol_classes():
    service = sorted((ROOT / "retriever" / "service").glob("*.py"))
    users = {p.name for p in service if any(m.startswith("uvicorn.protocols") for m in imported_modules(p))}
    assert users == {"fast_http.py"}
