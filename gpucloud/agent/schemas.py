"""The host agent's wire models: what the control plane sends to an agent (the real one or a
simulated node) and what it answers. Both ends import them from here."""

from __future__ import annotations

from pydantic import BaseModel, Field

# The actions every agent serves at `POST /actions/{action}`.
ACTIONS = ("inspect", "burn_in", "provision", "release", "wipe", "reset", "reboot", "reflash")


class ActionRequest(BaseModel):
    request_id: str = Field(min_length=1, max_length=300)
    tenant_id: str | None = None
    # The allocation a provision is for: what the node's usage is metered against.
    allocation_id: str | None = Field(None, min_length=1, max_length=200)
    # A wipe's next agent credential (`gpa_<node id>.<secret>`): the agent reports with it once
    # the wipe succeeded; the control plane then revokes the old one.
    credential: str | None = Field(None, min_length=1, max_length=300)
