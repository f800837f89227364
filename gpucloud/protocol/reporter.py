"""The one client a node's agent, real (`agent/reporting.py`) or simulated (`sim/fleet.py`,
`sim/fault_injection.py`), sends its reports with: each kind of report to its path, in its batch
model (`protocol.reports`), which is what the API's routes accept."""

from __future__ import annotations

from collections.abc import Sequence

import httpx
from pydantic import BaseModel

from gpucloud.protocol.reports import (
    Heartbeat,
    HeartbeatBatch,
    NodeReading,
    ReadingBatch,
    SignalReport,
    SignalReportBatch,
    XidEvent,
    XidEventBatch,
)

HEARTBEATS_PATH = "/v1/agents/heartbeats"
READINGS_PATH = "/v1/agents/readings"
EVENTS_PATH = "/v1/agents/events"
SIGNALS_PATH = "/v1/agents/signals"
# A re-imaged node's booted agent redeems its config drive's one-time token here
# (`services/agent_enrollment.py`) for the node's new credential.
ENROLL_PATH = "/v1/agents/enroll"


class ReportClient:
    """Posts reports over `client` to the control plane at `base_url` ("" when the client has its
    base URL). `credential` names the sender of one request (a simulated fleet speaks for many
    nodes, each with its own); without one the client's own auth goes (the agent's credential,
    or the simulator's operator token). Answers come back as they came: the caller decides
    whether a refusal is kept, retried or logged."""

    def __init__(self, client: httpx.AsyncClient, base_url: str = "") -> None:
        self.client, self.base_url = client, base_url.rstrip("/")

    async def heartbeats(self, beats: Sequence[Heartbeat], *, credential: str | None = None) -> httpx.Response:
        return await self._post(HEARTBEATS_PATH, HeartbeatBatch(heartbeats=list(beats)), credential)

    async def readings(self, readings: Sequence[NodeReading], *, credential: str | None = None) -> httpx.Response:
        return await self._post(READINGS_PATH, ReadingBatch(readings=list(readings)), credential)

    async def events(self, events: Sequence[XidEvent], *, credential: str | None = None) -> httpx.Response:
        return await self._post(EVENTS_PATH, XidEventBatch(events=list(events)), credential)

    async def signals(self, reports: Sequence[SignalReport], *, credential: str | None = None) -> httpx.Response:
        return await self._post(SIGNALS_PATH, SignalReportBatch(reports=list(reports)), credential)

    async def enroll(self, enrollment_token: str) -> httpx.Response:
        """Redeem a config drive's one-time enrollment token: 200 with `{"credential": ...}`."""
        headers = {"Authorization": f"Bearer {enrollment_token}"}
        # A no-op auth: the client's own (the agent's current credential) would replace the token.
        return await self.client.post(f"{self.base_url}{ENROLL_PATH}", headers=headers, auth=httpx.Auth())

    async def _post(self, path: str, batch: BaseModel, credential: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {credential}"} if credential else None
        return await self.client.post(f"{self.base_url}{path}", json=batch.model_dump(mode="json"), headers=headers)
