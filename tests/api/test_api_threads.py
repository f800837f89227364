"""The API's dependencies are coroutines: FastAPI runs every plain `def` dependency on a worker
thread, a hop there and back (the GIL handed over twice) for a line of work, and a yielded
database session would be opened on one thread and closed on another. Handlers open their
sessions themselves, inside their own thread."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from gpucloud.api.app import create_app
from gpucloud.config import Settings

pytestmark = pytest.mark.unit


def _calls(dependant: Dependant) -> Iterator[object]:
    for sub in dependant.dependencies:
        if sub.call is not None:
            yield sub.call
        yield from _calls(sub)


def _runs_on_a_thread(call: object) -> bool:
    target = call if inspect.isfunction(call) else getattr(call, "__call__", call)  # noqa: B004
    return not (inspect.iscoroutinefunction(target) or inspect.isasyncgenfunction(target))


def test_no_route_sends_a_dependency_that_does_not_block_to_a_thread(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path), temporal=object())  # type: ignore[arg-type]
    # Every route with its router's dependencies in its own (`web/routes.mount`: none added at an include).
    routes = [route for route in app.routes if isinstance(route, APIRoute)]
    threaded = {
        f"{route.path} {getattr(call, '__qualname__', call)}"
        for route in routes
        for call in _calls(route.dependant)
        if _runs_on_a_thread(call)
    }
    assert len(routes) > 50
    assert not threaded, sorted(threaded)
