"""One door to a database session: the injected `Database` (`db.session()`, `db.reads()`), built
once by the bootstrap. No module of gpucloud but `gpucloud/db.py` opens a session from a URL with
`session_scope(url)`; the modules that still do are listed here, and the list only shrinks (an
entry that no longer calls it fails the test until it is taken off)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gpucloud

pytestmark = pytest.mark.unit

PACKAGE = Path(gpucloud.__file__).parent

# Still opening sessions from a URL (being reworked elsewhere): take an entry off when it moves.
KNOWN_URL_SESSIONS: set[str] = set()


def _module(path: Path) -> str:
    return ".".join(("gpucloud", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")


def _calls_session_scope(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name == "session_scope":
                return True
    return False


def _callers() -> set[str]:
    return {
        _module(path)
        for path in PACKAGE.rglob("*.py")
        if path != PACKAGE / "db.py" and _calls_session_scope(ast.parse(path.read_text(), filename=str(path)))
    }


def test_no_module_opens_a_session_from_a_url() -> None:
    callers = _callers()
    new = sorted(callers - KNOWN_URL_SESSIONS)
    gone = sorted(KNOWN_URL_SESSIONS - callers)
    assert new == [], f"open sessions through the injected Database (db.session()), not session_scope(url): {new}"
    assert gone == [], f"these no longer call session_scope: take them off KNOWN_URL_SESSIONS: {gone}"


def test_the_check_sees_a_call() -> None:
    assert _calls_session_scope(ast.parse("with session_scope(url) as s: pass"))
    assert _calls_session_scope(ast.parse("with db.session_scope(url) as s: pass"))
    assert not _calls_session_scope(ast.parse("with db.session() as s: pass"))
