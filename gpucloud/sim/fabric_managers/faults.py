"""Faults for tests (`PUT /sim/v1/fault`): a manager down, or reads that disagree with writes."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import Field

from gpucloud.sim.fabric_managers.state import Body, StateDep


class FaultSetting(Body):
    mode: Literal["unavailable", "stale_reads"] | None = Field(description="None: no fault")


faults = APIRouter(prefix="/sim/v1", tags=["simulator"])


@faults.put("/fault", response_model=FaultSetting)
async def set_fault(body: FaultSetting, state: StateDep) -> FaultSetting:
    with state.lock:
        state.fault = body.mode
    return body
