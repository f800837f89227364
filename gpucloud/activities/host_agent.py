"""Activities that call a node's host agent over HTTP (the real agent or the simulated fleet).

The agent API: `POST {agent_url}/actions/{action}` with `{"request_id", "tenant_id"}`; the agent
deduplicates by request_id, so a retried activity never runs an action twice. Errors are
classified here: connection errors, timeouts and 5xx are transient (Temporal retries them with
backoff); a 4xx is the agent refusing the action for good (non-retryable `AgentActionFailed`),
which sends the node to its failure target. Long actions heartbeat while they wait.
"""

from __future__ import annotations

import asyncio

import httpx
from temporalio import activity
from temporalio.exceptions import ApplicationError

from gpucloud.models.messages import AgentActionInput, AgentActionResult

HEARTBEAT_EVERY_S = 5.0


class HostAgentActivities:
    def __init__(self, *, timeout_s: float = 600.0, max_connections: int = 200) -> None:
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _call(self, action: str, req: AgentActionInput) -> AgentActionResult:
        url = f"{req.agent_url.rstrip('/')}/actions/{action}"
        call = asyncio.ensure_future(
            self._client.post(url, json={"request_id": req.request_id, "tenant_id": req.tenant_id})
        )
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=HEARTBEAT_EVERY_S)
                if done:
                    break
                activity.heartbeat(action)
            response = call.result()
        except httpx.HTTPError as exc:
            raise RuntimeError(f"agent for {req.node_id} unreachable during {action}: {exc!r}") from exc
        finally:
            if not call.done():
                call.cancel()
        if response.status_code >= 500:
            raise RuntimeError(f"agent for {req.node_id} failed {action} (HTTP {response.status_code}):"
                               f" {response.text[:300]}")
        if response.status_code >= 400:
            raise ApplicationError(
                f"agent for {req.node_id} refused {action} (HTTP {response.status_code}): {response.text[:300]}",
                type="AgentActionFailed", non_retryable=True,
            )
        return AgentActionResult(node_id=req.node_id, action=action, details=response.json())

    @activity.defn
    async def inspect_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._call("inspect", req)

    @activity.defn
    async def burn_in_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._call("burn_in", req)

    @activity.defn
    async def provision_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._call("provision", req)

    @activity.defn
    async def release_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._call("release", req)

    @activity.defn
    async def wipe_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._call("wipe", req)

    # The repair ladder, mildest first: a GPU reset, a host reboot, a firmware/OS reflash.
    @activity.defn
    async def reset_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._call("reset", req)

    @activity.defn
    async def reboot_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._call("reboot", req)

    @activity.defn
    async def reflash_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._call("reflash", req)

    def all(self) -> list:
        return [self.inspect_node, self.burn_in_node, self.provision_node, self.release_node, self.wipe_node,
                self.reset_node, self.reboot_node, self.reflash_node]
