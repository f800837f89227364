"""`mount`: an app's routes are the route objects its router modules built, added as they are.

FastAPI's `include_router` wraps a router for the app that includes it and, on the app's first
requests, builds every route of it again for that app (each endpoint's signature read, each
parameter's pydantic field made): 0.13 to 0.29 CPU-s for the API's 141 routes, paid by every
process that builds an app, and by each of the hundreds of apps the test suite builds (a fifth of
the CPU a test of the whole stack spends in its own process, `py-spy --gil`). A route object is
complete when its module's decorator has run (`APIRoute` reads its endpoint then), and the app
matches it like one of its own (`/healthz`), so the routers' routes are added to the app in their
order and built once per process. Include-time options (a prefix, dependencies, tags) would be
lost this way, so `mount` takes only routers whose routes carry their own, and refuses a router
nested in another: list its routers instead (`ROUTERS` in `api/routers/registry`, `console/routes`).
"""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute


def mount(app: FastAPI, routers: Iterable[APIRouter]) -> None:
    """Add each router's routes to `app`, in order (a request is matched against them in it).
    Call it while building the app, before its OpenAPI document is first asked for: the routes
    are appended as they are, which FastAPI's cache of that document does not notice."""
    for router in routers:
        for route in router.routes:
            if not isinstance(route, APIRoute):
                raise TypeError(f"{route!r} is not a route of its own: mount the routers it holds one by one")
            app.router.routes.append(route)
