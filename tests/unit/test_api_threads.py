"""The API's dependencies that only read the app's state or the caller the gate found are
coroutines: FastAPI runs every plain `def` dependency on a worker thread, a hop there and back
(with the GIL handed over twice) for a line of work. Only those that hold a database session
may take a thread."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from gpucloud.api.app import create_app
from gpucloud.api.deps import get_session
from gpucloud.config import Settings

# Dependencies that block (a database session, yielded): a worker thread is their place.
MAY_BLOCK = {get_session}


def _calls(dependant: Dependant) -> Iterator[object]:
    for sub in dependant.dependencies:
        if sub.call is not None:
            yield sub.call
        yield from _calls(sub)


def _api_routes(routes: list) -> Iterator[APIRoute]:
    """Every route, those of included routers too (FastAPI keeps an included router whole)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        elif (included := getattr(route, "original_router", None)) is not None:
            yield from _api_routes(included.routes)


def _runs_on_a_thread(call: object) -> bool:
    target = call if inspect.isfunction(call) else getattr(call, "__call__", call)  # noqa: B004
    return not (inspect.iscoroutinefunction(target) or inspect.isasyncgenfunction(target))


def test_no_route_sends_a_dependency_that_does_not_block_to_a_thread(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path), temporal=object())  # type: ignore[arg-type]
    routes = list(_api_routes(app.routes))
    threaded = {
        f"{route.path} {getattr(call, '__qualname__', call)}"
        for route in routes
        for call in _calls(route.dependant)
        if call not in MAY_BLOCK and _runs_on_a_thread(call)
    }
    assert len(routes) > 50
    assert not threaded, sorted(threaded)
