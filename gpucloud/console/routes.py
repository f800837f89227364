"""Every console router, for the API app to mount in this order (`api/app.py`, `web/routes.mount`)."""

from __future__ import annotations

from gpucloud.console import (
    account,
    allocations,
    billing,
    fleet,
    incidents,
    operator_pages,
    reservations,
    rollouts,
    sign_in,
)

ROUTERS = tuple(
    module.router
    for module in (sign_in, fleet, allocations, operator_pages, incidents, account, rollouts, reservations, billing)
)
