"""Every httpx client of the package comes from one factory (`gpucloud.web.http_client`), so
every client has a named timeout and the trust it was given.

Read from the source (`ast`): a call of `httpx.Client` or `httpx.AsyncClient`, or of httpx's
one-shot functions (`httpx.get`, ...: each builds a client with httpx's defaults), however httpx or
the name was imported, anywhere but the factory. `KNOWN_OWN_CLIENTS` lists the modules still
building their own; each entry must still be true (a converted module takes its entry with it),
so the list only shrinks.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gpucloud"
FACTORY = "gpucloud/web/http_client.py"
CLIENT_CLASSES = {"Client", "AsyncClient"}
ONE_SHOT = {"request", "stream", "get", "options", "head", "post", "put", "patch", "delete"}
BUILDERS = CLIENT_CLASSES | ONE_SHOT

# Still building their own httpx clients (being moved by others; converted later): only shrinks.
KNOWN_OWN_CLIENTS: set[str] = set()


def _constructions(tree: ast.Module) -> list[int]:
    """The lines that build an httpx client (a client class or a one-shot function called)."""
    modules, classes = {"httpx"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {alias.asname or alias.name for alias in node.names if alias.name == "httpx"}
        elif isinstance(node, ast.ImportFrom) and node.module == "httpx":
            classes |= {alias.asname or alias.name for alias in node.names if alias.name in BUILDERS}
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr in BUILDERS
            and isinstance(func.value, ast.Name)
            and func.value.id in modules
        ) or (isinstance(func, ast.Name) and func.id in classes):
            lines.append(node.lineno)
    return lines


@cache
def _builders() -> dict[str, list[int]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = _constructions(ast.parse(path.read_text(), filename=str(path)))
        if lines:
            found[path.relative_to(ROOT).as_posix()] = lines
    return found


def test_the_factory_is_seen_building_clients() -> None:
    assert FACTORY in _builders(), "the check no longer recognises a construction: fix _constructions"


def test_no_module_builds_its_own_httpx_client() -> None:
    own = {path: lines for path, lines in _builders().items() if path != FACTORY and path not in KNOWN_OWN_CLIENTS}
    assert not own, (
        "build httpx clients with gpucloud.web.http_client.http_client / async_http_client "
        f"(a named timeout, the trust passed in), not httpx.Client / AsyncClient / get / post ...: {own}"
    )


def test_every_known_own_client_is_still_true() -> None:
    stale = sorted(KNOWN_OWN_CLIENTS - set(_builders()))
    assert not stale, f"these build no httpx client any more: remove them from KNOWN_OWN_CLIENTS: {stale}"
