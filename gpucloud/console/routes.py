"""Every console route, for the API app to include once (`api/app.py`)."""

from __future__ import annotations

from fastapi import APIRouter

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

router = APIRouter()
for module in (sign_in, fleet, allocations, operator_pages, incidents, account, rollouts, reservations, billing):
    router.include_router(module.router)
