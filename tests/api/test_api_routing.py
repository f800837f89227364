"""The agents' reports are matched first. A request is checked against every route before its
own (twice: once to find its router, once inside it), and the fleet's reports are most of the
API's requests, so they must not wait behind the tenants', keys', allocations' and nodes' routes."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.routing import APIRoute
from starlette.routing import Match

from gpucloud.api.app import create_app
from gpucloud.config import Settings

pytestmark = pytest.mark.unit


def _tried_before(app, method: str, path: str) -> int:
    """How many of the API's routes a request is checked against before the one that answers
    it, in the order the app matches them (an included router's routes where it was included)."""
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": []}
    tried = 0
    for candidate in app.routes:
        router = getattr(candidate, "original_router", None)
        for route in router.routes if router is not None else [candidate]:
            if not isinstance(route, APIRoute):
                continue
            if route.matches(scope)[0] == Match.FULL:
                return tried
            tried += 1
    raise AssertionError(f"no route answers {method} {path}")


def test_the_agents_reports_are_the_first_routes_a_request_is_checked_against(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path), temporal=object())  # type: ignore[arg-type]
    reports = [
        "/v1/agents/heartbeats",
        "/v1/agents/readings",
        "/v1/agents/events",
        "/v1/agents/signals",
        "/v1/agents/ledger-token",
    ]
    assert sorted(_tried_before(app, "POST", path) for path in reports) == [0, 1, 2, 3, 4]
    # Then what tenants poll: an allocation comes before the tenants', keys' and nodes' routes.
    assert _tried_before(app, "GET", "/v1/allocations/alloc-1") < 10
