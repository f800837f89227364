"""Activities that call a node's host agent over HTTP (the real agent or the simulated fleet).

The agent API: `POST {agent_url}/actions/{action}` with an `ActionRequest` (`gpucloud.protocol`); the agent
deduplicates by request_id, so a retried activity never runs an action twice. Errors are
classified here: connection errors, timeouts and 5xx are transient (Temporal retries them with
backoff); a 4xx is the agent refusing the action for good (non-retryable `AgentActionFailed`),
which sends the node to its failure target. Long actions heartbeat while they wait.

A wipe's answer says how the node was cleaned, step by step (`CleaningStep`: its GPUs reset, each
tenant disk sanitized, the tenant's files removed); each step is recorded as an event in the
node's history (`services.cleaning`), once per wipe however often the activity is retried. A
step the answer marks failed fails the wipe, as the agent's own refusal would.
"""

from __future__ import annotations

import asyncio
import functools

from pydantic import TypeAdapter, ValidationError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from gpucloud.activities import ActivityGroup
from gpucloud.adapters.host_agent import AgentRefused, AgentUnreachable, HostAgents
from gpucloud.db import Database
from gpucloud.models.messages import AgentActionInput, AgentActionResult, AgentBatchInput, AgentBatchResult
from gpucloud.protocol.actions import ActionRequest, AgentAction, CleaningStep
from gpucloud.retry import Backoff, retry_call_async
from gpucloud.services.agent_credentials import WipeRotation
from gpucloud.services.cleaning import record_cleaning

HEARTBEAT_EVERY_S = 5.0
# A batch calls this many agents at once.
BATCH_CONCURRENCY = 32
# The longest a batch waits between two calls to one agent (its delays double from the base).
BATCH_RETRY_CAP_S = 30.0
_CLEANING = TypeAdapter(list[CleaningStep])


class HostAgentActivities(ActivityGroup):
    def __init__(
        self,
        agents: HostAgents,
        *,
        db: Database | None = None,
        rotation: WipeRotation | None = None,
        batch_attempts: int = 4,
        batch_retry_base_s: float = 0.5,
    ) -> None:
        # A wipe replaces the node's agent credential (see `WipeRotation`).
        self.rotation = rotation
        self.db = db  # where a wipe's cleaning steps are recorded (None: they are not)
        # A batch retries an agent that is unreachable or answers 5xx this many times (delays
        # doubling from the base) before it leaves that node to the reconciler.
        self.agents = agents
        self.batch_attempts = max(1, batch_attempts)
        self.batch_retry_base_s = batch_retry_base_s

    async def _call(self, action: AgentAction, req: AgentActionInput, *, commit: bool = True) -> AgentActionResult:
        """One action on one agent; a wipe's cleaning is recorded and its new credential committed
        here unless `commit` is False (the caller does both for many at once)."""
        body = ActionRequest(
            request_id=req.request_id, tenant_id=req.tenant_id, allocation_id=req.allocation_id, workload=req.workload
        )
        rotates = action == AgentAction.WIPE and self.rotation is not None and req.hand_credential
        if rotates:
            assert self.rotation is not None
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
        if action == AgentAction.WIPE:
            steps = _cleaning(req.node_id, details)
            if commit:
                await asyncio.to_thread(self._record_cleaning, [(req.node_id, req.request_id, steps)])
            _fail_unclean(req.node_id, steps)
        if rotates and commit:
            assert self.rotation is not None
            # The agent took up the next credential with the wipe: the old one goes now.
            await asyncio.to_thread(self.rotation.commit, req.node_id, req.request_id)
        return AgentActionResult(node_id=req.node_id, action=action, details=details)

    def _record_cleaning(self, wiped: list[tuple[str, str, list[CleaningStep]]]) -> None:
        if self.db is None or not wiped:
            return
        with self.db.session() as session:
            record_cleaning(session, wiped)

    @activity.defn
    async def agent_batch(self, req: AgentBatchInput) -> AgentBatchResult:
        """One action on many nodes' agents (a bring-up batch), BATCH_CONCURRENCY at a time.

        Unlike the per-node activities, transient failures are retried here, per node, so one
        silent agent neither fails the batch nor makes Temporal repeat every other node's call;
        a node still unreachable after `batch_attempts` is reported and left to the reconciler.
        The agents deduplicate by request_id, so a retry of this whole activity is harmless.
        """
        result = AgentBatchResult()
        backoff = Backoff(first_s=self.batch_retry_base_s, cap_s=max(BATCH_RETRY_CAP_S, self.batch_retry_base_s))
        gate = asyncio.Semaphore(BATCH_CONCURRENCY)
        done = 0
        wiped: list[tuple[str, str]] = []  # (node id, request id): credentials to commit
        cleaned: list[tuple[str, str, list[CleaningStep]]] = []  # and their cleaning, to record

        async def one(item: AgentActionInput) -> None:
            nonlocal done
            async with gate:
                try:
                    answer = await retry_call_async(
                        functools.partial(self._call, req.action, item, commit=False),
                        retry_on=AgentUnreachable,
                        backoff=backoff,
                        attempts=self.batch_attempts,
                        deadline_s=None,
                    )
                    if item.hand_credential:
                        wiped.append((item.node_id, item.request_id))
                    if req.action == AgentAction.WIPE:
                        cleaned.append((item.node_id, item.request_id, _cleaning(item.node_id, answer.details)))
                except ApplicationError as exc:
                    result.failed[item.node_id] = exc.message
                except AgentUnreachable as exc:
                    result.unreachable[item.node_id] = str(exc)
            done += 1

        calls = asyncio.ensure_future(asyncio.gather(*(one(item) for item in req.items)))
        try:
            while True:
                finished, _ = await asyncio.wait({calls}, timeout=HEARTBEAT_EVERY_S)
                if finished:
                    calls.result()
                    await asyncio.to_thread(self._record_cleaning, cleaned)
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

    # A scheduled diagnostic of an idle node (`services/diagnostics.py`); the agent refuses a
    # node a tenant holds.
    @activity.defn
    async def diagnose_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._call(AgentAction.DIAGNOSE, req)


def _cleaning(node_id: str, details: dict) -> list[CleaningStep]:
    """The steps a wipe's answer lists (none: an agent that does not report them). An answer that
    cannot be read fails the wipe: nothing is taken for clean on words the control plane cannot
    check."""
    try:
        return _CLEANING.validate_python(details.get("cleaning") or [])
    except ValidationError as exc:
        raise ApplicationError(
            f"agent for {node_id} answered its wipe with cleaning steps that cannot be read: {exc}",
            type="AgentActionFailed",
            non_retryable=True,
        ) from exc


def _fail_unclean(node_id: str, steps: list[CleaningStep]) -> None:
    """A wipe answered as done with a step it marks failed is a failed wipe."""
    failed = next((step for step in steps if not step.ok), None)
    if failed is not None:
        raise ApplicationError(
            f"agent for {node_id} answered its wipe, but its {failed.step} of {failed.target or 'the node'} "
            f"failed: {failed.answer}",
            type="AgentActionFailed",
            non_retryable=True,
        )
