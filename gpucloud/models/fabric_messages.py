"""Inputs and results of the fabric activities (`activities/fabric.py`): one pydantic model each.

Workflow code imports these, so this module imports nothing heavier than pydantic.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class FabricApplyInput(BaseModel):
    """Make the allocation's fabric membership exactly its nodes (as the database records them)
    plus `joining`: nodes reserved for it and not attached yet (a replacement)."""

    allocation_id: str
    joining: list[str] = Field(default_factory=list)


class FabricRemoveInput(BaseModel):
    """Take these nodes (pulled from the allocation, or a replacement given up) out of it."""

    allocation_id: str
    node_ids: list[str]


class FabricReleaseInput(BaseModel):
    allocation_id: str


class FabricMembershipResult(BaseModel):
    allocation_id: str
    # False: no fabric managers are configured (the embedded default), nothing was done.
    applied: bool
    node_ids: list[str] = Field(default_factory=list)
    pkey: int | None = None
    nvl_partition_ids: list[int] = Field(default_factory=list)
    vni: int | None = None
