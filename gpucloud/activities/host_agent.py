"""Activities that call a node's host agent over HTTP (the real agent or the simulated fleet).

The agent API: `POST {agent_url}/actions/{action}` with an `ActionRequest` (`gpucloud.protocol`); the agent
deduplicates by request_id, so a retried activity never runs an action twice. Errors are
classified here: connection errors, timeouts and 5xx are transient (Temporal retries them with
backoff); a 4xx is the agent refusing the action for good (non-retryable `AgentActionFailed`),
which sends the node to its failure target. Long actions heartbeat while they wait.
"""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.exceptions import ApplicationError

from gpucloud.activities import ActivityGroup
from gpucloud.adapters.host_agent import AgentRefused, AgentUnreachable, HostAgents
from gpucloud.models.messages import AgentActionInput, AgentActionResult, AgentBatchInput, AgentBatchResult
from gpucloud.protocol.actions import ActionRequest, AgentAction
from gpucloud.services.agent_credentials import WipeRotation

HEARTBEAT_EVERY_S = 5.0
# A batch calls this many agents at once.
BATCH_CONCURRENCY = 32


class HostAgentActivities(ActivityGroup):
    def __init__(
        self,
        agents: HostAgents,
        *,
        rotation: WipeRotation | None = None,
        batch_attempts: int = 4,
        batch_retry_base_s: float = 0.5,
    ) -> None:
        # A wipe replaces the node's agent credential (see `WipeRotation`).
        self.rotation = rotation
        # A batch retries an agent that is unreachable or answers 5xx this many times (delays
        # doubling from the base) before it leaves that node to the reconciler.
        self.agents = agents
        self.batch_attempts = max(1, batch_attempts)
        self.batch_retry_base_s = batch_retry_base_s

    async def _call(self, action: AgentAction, req: AgentActionInput, *, commit: bool = True) -> AgentActionResult:
        """One action on one agent; a wipe's new credential is committed here unless `commit` is
        False (the caller commits many at once)."""
        body = ActionRequest(
            request_id=req.request_id, tenant_id=req.tenant_id, allocation_id=req.allocation_id, workload=req.workload
        )
        if action == AgentAction.WIPE and self.rotation is not None:
            body.credential = self.rotation.next_token(req.node_id, req.request_id)
        call = asyncio.ensure_future(self.agents.act(req.agent_url, action, body, node_id=req.node_id))
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=HEARTBEAT_EVERY_S)
                if done:
                    break
                activity.heartbeat(action)
            details = call.result()
        except AgentRefused as exc:
            raise ApplicationError(str(exc), type="AgentActionFailed", non_retryable=True) from exc
        finally:
            if not call.done():
                call.cancel()
        if action == AgentAction.WIPE and self.rotation is not None and commit:
            # The agent took up the next credential with the wipe: the old one goes now.
            await asyncio.to_thread(self.rotation.commit, req.node_id, req.request_id)
        return AgentActionResult(node_id=req.node_id, action=action, details=details)

    @activity.defn
    async def agent_batch(self, req: AgentBatchInput) -> AgentBatchResult:
        """One action on many nodes' agents (a bring-up batch), BATCH_CONCURRENCY at a time.

        Unlike the per-node activities, transient failures are retried here, per node, so one
        silent agent neither fails the batch nor makes Temporal repeat every other node's call;
        a node still unreachable after `batch_attempts` is reported and left to the reconciler.
        The agents deduplicate by request_id, so a retry of this whole activity is harmless.
        """
        result = AgentBatchResult()
        gate = asyncio.Semaphore(BATCH_CONCURRENCY)
        done = 0
        wiped: list[tuple[str, str]] = []  # (node id, request id): credentials to commit

        async def one(item: AgentActionInput) -> None:
            nonlocal done
            async with gate:
                for attempt in range(self.batch_attempts):
                    try:
                        await self._call(req.action, item, commit=False)
                        wiped.append((item.node_id, item.request_id))
                        break
                    except ApplicationError as exc:
                        result.failed[item.node_id] = exc.message
                        break
                    except AgentUnreachable as exc:
                        if attempt == self.batch_attempts - 1:
                            result.unreachable[item.node_id] = str(exc)
                        else:
                            await asyncio.sleep(self.batch_retry_base_s * 2**attempt)
            done += 1

        calls = asyncio.ensure_future(asyncio.gather(*(one(item) for item in req.items)))
        try:
            while True:
                finished, _ = await asyncio.wait({calls}, timeout=HEARTBEAT_EVERY_S)
                if finished:
                    calls.result()
                    if req.action == AgentAction.WIPE and self.rotation is not None:
                        # The agents took up their next credentials: the old ones go now, in
                        # one transaction (a retry of this activity commits the same ones).
                        await asyncio.to_thread(self.rotation.commit_many, wiped)
                    return result
                activity.heartbeat(f"{req.action}: {done}/{len(req.items)}")
        finally:
            if not calls.done():
                calls.cancel()

    @activity.defn
    async def inspect_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._call(AgentAction.INSPECT, req)

    @activity.defn
    async def burn_in_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._call(AgentAction.BURN_IN, req)

    @activity.defn
    async def provision_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._call(AgentAction.PROVISION, req)

    @activity.defn
    async def release_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._call(AgentAction.RELEASE, req)

    @activity.defn
    async def wipe_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._call(AgentAction.WIPE, req)

    # The repair ladder, mildest first: a GPU reset, a host reboot, a firmware/OS reflash.
    @activity.defn
    async def reset_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._call(AgentAction.RESET, req)

    @activity.defn
    async def reboot_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._call(AgentAction.REBOOT, req)

    @activity.defn
    async def reflash_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._call(AgentAction.REFLASH, req)
