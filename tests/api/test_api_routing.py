"""The agents' reports are matched first. A request is checked against every route before its
own, and the fleet's reports are most of the API's requests, so they must not wait behind the
tenants', keys', allocations' and nodes' routes. The routes are the ones their modules built,
mounted as they are (`web/routes.mount`): no app builds them again."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from starlette.routing import Match, Route

from gpucloud.api.app import create_app
from gpucloud.config import Settings
from gpucloud.ledger.app import create_app as create_ledger_app
from gpucloud.web.routes import mount

pytestmark = pytest.mark.unit


def _tried_before(app, method: str, path: str) -> int:
    """How many of the API's routes a request is checked against before the one that answers
    it, in the order the app matches them."""
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": []}
    tried = 0
    for route in app.routes:
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


def test_each_app_serves_the_route_objects_its_modules_built(tmp_path: Path) -> None:
    """`include_router` would wrap each router for the app and build all its routes again on
    that app's first requests (0.13 to 0.29 CPU-s an app). Mounted, two apps of one process hold
    the same route objects, and every entry of an app's routes is a route, not a router."""
    apps = [create_app(Settings(data_dir=tmp_path / name), temporal=object()) for name in ("a", "b")]  # type: ignore[arg-type]
    ledgers = [create_ledger_app(f"sqlite:///{tmp_path / name}.db", control_plane=None) for name in ("c", "d")]  # type: ignore[arg-type]
    for first, second in (apps, ledgers):
        assert all(isinstance(route, Route) for route in first.routes), [type(r) for r in first.routes]
        shared = {id(route) for route in first.routes} & {id(route) for route in second.routes}
        mounted = [route for route in first.routes if id(route) in shared]
        # The apps' own few (`/healthz`, `/readyz`, `/metrics`, the OpenAPI document) are theirs.
        assert len(mounted) >= len(first.routes) - 8 and mounted, (len(mounted), len(first.routes))
    assert len([route for route in apps[0].routes if isinstance(route, APIRoute)]) > 140


def test_a_router_that_holds_routers_is_refused_by_name() -> None:
    from gpucloud.api.routers import nodes

    outer = APIRouter()
    outer.include_router(nodes.router)
    with pytest.raises(TypeError, match="mount the routers it holds one by one"):
        mount(FastAPI(), [outer])
