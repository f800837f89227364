"""The control plane's client of host agents: `POST {agent_url}/actions/{action}` with an
`ActionRequest` (the real agent and the simulated fleet serve the same API and share its wire
models, `gpucloud.agent.schemas`).

Errors are classified here, once: no connection, a timeout or a 5xx is `AgentUnreachable`
(transient: try again later); a 4xx is `AgentRefused` (the agent said no for good).
"""

from __future__ import annotations

from typing import Any, Protocol

import httpx

from gpucloud.agent.schemas import ActionRequest
from gpucloud.web import tls
from gpucloud.web.service_tokens import Issuer, agent_audience


class AgentUnreachable(RuntimeError):
    """Transient: no connection, a timeout or a 5xx."""


class AgentRefused(RuntimeError):
    """The agent refused the action (a 4xx): retrying cannot help."""


class HostAgents(Protocol):
    async def act(self, agent_url: str, action: str, req: ActionRequest, *, node_id: str) -> dict[str, Any]: ...

    async def aclose(self) -> None: ...


class HttpHostAgents:
    """One pooled HTTP client for every agent of the fleet."""

    def __init__(self, *, issuer: Issuer | None = None, timeout_s: float = 600.0, max_connections: int = 200) -> None:
        self._issuer = issuer
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            verify=tls.client_verify(),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def act(self, agent_url: str, action: str, req: ActionRequest, *, node_id: str) -> dict[str, Any]:
        """Run `action` on the agent; its answer. The agent deduplicates by `request_id`."""
        url = f"{agent_url.rstrip('/')}/actions/{action}"
        try:
            response = await self._client.post(url, json=req.model_dump(mode="json"), headers=self._auth(node_id))
        except httpx.HTTPError as exc:
            raise AgentUnreachable(f"agent for {node_id} unreachable during {action}: {exc!r}") from exc
        if response.status_code >= 500:
            raise AgentUnreachable(
                f"agent for {node_id} failed {action} (HTTP {response.status_code}): {response.text[:300]}"
            )
        if response.status_code >= 400:
            raise AgentRefused(
                f"agent for {node_id} refused {action} (HTTP {response.status_code}): {response.text[:300]}"
            )
        return response.json()

    def _auth(self, node_id: str) -> dict[str, str]:
        """A token for this node's agent only: one captured on a node opens no other."""
        if self._issuer is None:
            return {}
        return {"Authorization": f"Bearer {self._issuer.mint(agent_audience(node_id))}"}
