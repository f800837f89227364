"""The ledger's admission: the same lanes as the API's (`web/admission.py`), by the role of the
token the gate checked. Nodes' agents post their own usage, and tenants have root on the nodes
they rent: one node may hold at most its share of the agents' lane, so a node that floods the
ledger is answered 429 at once and the others' samples still land; the control plane and
operators (allocation events, closes, invoices) have a lane of their own."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from gpucloud.config import LedgerSettings
from gpucloud.ledger.api.callers import OPEN_PATHS
from gpucloud.web.admission import Lane, admit


class LedgerAdmission:
    """ASGI middleware inside the gate (it reads the claims the gate found)."""

    def __init__(self, app: ASGIApp, *, settings: LedgerSettings) -> None:
        self.app, self.wait_s = app, settings.admission_wait_s
        self.agents = Lane("agents", settings.agent_slots, settings.node_share)
        self.control_plane = Lane("control-plane", settings.control_plane_slots)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or "claims" not in scope.get("state", {}):
            await self.app(scope, receive, send)
            return
        claims = scope["state"]["claims"]
        lane = self.agents if claims.role == "agent" else self.control_plane
        await admit(lane, claims.subject, self.wait_s, self.app, scope, receive, send)
