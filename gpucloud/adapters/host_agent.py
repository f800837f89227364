"""The control plane's client of host agents: `POST {agent_url}/actions/{action}` with an
`ActionRequest` (the real agent and the simulated fleet serve the same API and share its wire
models, `gpucloud.protocol.actions`), and `GET {agent_url}/workload/logs` for what a node's
workload printed (`open_logs`, `gpucloud.protocol.logs`).

Errors are classified here, once: no connection, a timeout or a 5xx is `AgentUnreachable`
(transient: try again later); a 4xx is `AgentRefused` (the agent said no for good).
"""

from __future__ import annotations

from typing import Any, Protocol

import httpx
from pydantic import ValidationError

from gpucloud.protocol.actions import ActionAnswer, ActionRequest, AgentAction
from gpucloud.protocol.logs import WORKLOAD_LOGS_PATH
from gpucloud.web import tls
from gpucloud.web.http_client import async_http_client
from gpucloud.web.service_tokens import LOG_READER, Issuer, Minter, agent_audience, agent_logs_audience


class AgentUnreachable(RuntimeError):
    """Transient: no connection, a timeout or a 5xx."""


class AgentRefused(RuntimeError):
    """The agent refused the action (a 4xx): retrying cannot help."""


class HostAgents(Protocol):
    async def act(self, agent_url: str, action: AgentAction, req: ActionRequest, *, node_id: str) -> dict[str, Any]: ...

    async def call(
        self,
        method: str,
        agent_url: str,
        path: str,
        *,
        node_id: str,
        json: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> httpx.Response: ...

    async def aclose(self) -> None: ...


def _answer(response: httpx.Response, action: AgentAction, node_id: str) -> ActionAnswer:
    """The agent's 200 read as the protocol says (`ActionAnswer`), for this action on this node.
    Whatever answers on a node may be the previous tenant's program: an answer that does not
    parse, or speaks of another node or action, is refused, never taken as done."""
    try:
        answer = ActionAnswer.model_validate_json(response.content)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:3])
        raise AgentRefused(f"agent for {node_id} answered {action} with what the protocol does not allow: {problems}")
    if answer.action != action or answer.node_id != node_id:
        said = f"{answer.action} of node {answer.node_id}"
        raise AgentRefused(f"agent for {node_id} answered {action} as {said}: not this action's answer")
    return answer


class HttpHostAgents:
    """One pooled HTTP client for every agent of the fleet."""

    def __init__(
        self,
        *,
        issuer: Issuer | Minter | None = None,
        timeout_s: float = 600.0,
        max_connections: int = 200,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._issuer = issuer
        self._client = async_http_client(
            timeout="agent_action",
            timeout_s=timeout_s,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            trust=tls.client_verify(),
            transport=transport,  # tests answer for the agents
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def act(self, agent_url: str, action: AgentAction, req: ActionRequest, *, node_id: str) -> dict[str, Any]:
        """Run `action` on the agent; its answer. The agent deduplicates by `request_id`."""
        try:
            response = await self.call(
                "POST", agent_url, f"/actions/{action}", node_id=node_id, json=req.model_dump(mode="json")
            )
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
        return _answer(response, action, node_id).model_dump(mode="json")

    async def call(
        self,
        method: str,
        agent_url: str,
        path: str,
        *,
        node_id: str,
        json: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        """One request to the node's agent (its weights API: `/weights/...`); the answer as it
        came. `timeout_s`: this call's own (a prefetch of a whole version), else the client's.
        Raises `httpx.HTTPError` when the agent cannot be reached."""
        timeout = httpx.Timeout(timeout_s, connect=5.0) if timeout_s is not None else httpx.USE_CLIENT_DEFAULT
        return await self._client.request(
            method,
            f"{agent_url.rstrip('/')}{path}",
            json=json,
            params=params,
            headers=self._auth(node_id),
            timeout=timeout,
        )

    async def open_logs(
        self, agent_url: str, *, node_id: str, params: dict[str, str], timeout_s: float
    ) -> httpx.Response:
        """The node's workload output (`GET /workload/logs`, `protocol/logs.py`), its body not
        read yet: the caller streams it and closes it. Presents a log reader's token for this node
        (`log-reader`): what an API's delegate may mint, and all it opens. Raises
        `httpx.HTTPError` when the agent cannot be reached."""
        headers = {}
        if self._issuer is not None:
            token = self._issuer.mint(agent_logs_audience(node_id), role=LOG_READER)
            headers["Authorization"] = f"Bearer {token}"
        request = self._client.build_request(
            "GET",
            f"{agent_url.rstrip('/')}{WORKLOAD_LOGS_PATH}",
            params=params,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=5.0),
        )
        return await self._client.send(request, stream=True)

    def _auth(self, node_id: str) -> dict[str, str]:
        """A token for this node's agent only: one captured on a node opens no other."""
        if self._issuer is None:
            return {}
        return {"Authorization": f"Bearer {self._issuer.mint(agent_audience(node_id))}"}
