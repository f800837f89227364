"""Routers are thin: a module under `gpucloud/api/routers` parses the request, names the caller,
calls a service and shapes the answer; the queries (sqlmodel's and SQLAlchemy's `select`, `col`,
`update`, ...) are the services'. A router may name `Session` (the type of the session it hands a
service), nothing else of either library.

`KNOWN_QUERYING` lists the routers that still build queries. Each entry must still be true (a
router whose queries moved out takes its entry with it), so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROUTERS = Path(__file__).resolve().parents[2] / "gpucloud" / "api" / "routers"
QUERY_LIBRARIES = ("sqlalchemy", "sqlmodel")
# What a router may import from them: the type of the session it passes on.
ALLOWED = {"Session"}
# Still out of place (see the module docstring): this only shrinks.
KNOWN_QUERYING: set[str] = set()


def _library(module: str) -> bool:
    return module.split(".")[0] in QUERY_LIBRARIES


def _query_imports(path: Path) -> list[str]:
    """What the module imports of the query libraries beyond `ALLOWED` (lazy imports included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if _library(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _library(node.module or ""):
            found += [f"{node.module}.{alias.name}" for alias in node.names if alias.name not in ALLOWED]
    return found


def _querying() -> dict[str, list[str]]:
    return {path.name: names for path in sorted(ROUTERS.glob("*.py")) if (names := _query_imports(path))}


def test_no_router_builds_queries() -> None:
    querying = _querying()
    new = {name: names for name, names in querying.items() if name not in KNOWN_QUERYING}
    gone = sorted(KNOWN_QUERYING - set(querying))
    assert new == {}, f"move these queries into a service (gpucloud/services/*_requests.py): {new}"
    assert gone == [], f"these routers no longer build queries: take them off KNOWN_QUERYING: {gone}"


def test_the_check_sees_what_it_checks() -> None:
    """The reader finds a known query import, so an empty answer above means something."""
    service = ROUTERS.parent.parent / "services" / "rollout_requests.py"
    assert {"sqlmodel.select", "sqlalchemy"} <= set(_query_imports(service))
    assert len(list(ROUTERS.glob("*.py"))) > 10


SERVICES = ROUTERS.parents[1] / "services"
# What a service may take from the web layer's problem module: the helper that names a field.
PROBLEM_HELPERS = {"field_of"}


def test_services_refuse_with_domain_errors_not_problem_documents() -> None:
    """A service says what was wrong with a domain error (`services/errors.py`); the API's one
    handler turns it into a problem document. No service builds a `Problem` itself."""
    offenders = []
    for path in sorted(SERVICES.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "gpucloud.web.problems":
                offenders += [f"{path.name}: {a.name}" for a in node.names if a.name not in PROBLEM_HELPERS]
            elif isinstance(node, ast.ImportFrom) and node.module == "gpucloud.web":
                offenders += [f"{path.name}: gpucloud.web.{a.name}" for a in node.names if a.name == "problems"]
    assert offenders == []
