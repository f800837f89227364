"""The router of the agents' reports (`/v1/agents/...`: heartbeats, readings, XID events, the
ledger token). The handlers live beside the node and health logic they use (`nodes.py`,
`health.py`) and register here, because this router is matched first: a fleet's reports are
most of the API's requests (10,000 nodes at a 10 s heartbeat: 1,000 a second), and a request
is checked against each route before its own: a heartbeat registered among the nodes' routes
was checked against 34 routes first."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(prefix="/v1")
