"""Drain-and-replace inside an allocation workflow: pull nodes reported bad out of the allocation
and its fabric, drain them, and provision replacements from the same fabric domain.

`DrainAndReplace` is a collaborator of `AllocationWorkflow`, kept in its own module since it is
a process of its own, and holding its own state: the nodes reported and not pulled yet, the
nodes pulled and their drains, and, while the allocation is first provisioned, the replacement
provisions left. Several failed nodes (a burst) are all pulled first, together, then replaced
one after another; a node reported while a replacement provisions is pulled at once, not after
it; a pulled node's drain runs behind its replacement and is awaited before the run ends. A node
reported while the allocation is still provisioning is replaced before the allocation is first
`ready`, so the tenant is never handed a node known to be bad; a node that fails provisioning is
replaced the same way, at most `provision_retries` times.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from gpucloud.activities.control_db import ControlDbActivities
    from gpucloud.models.allocation_states import AllocationStatus
    from gpucloud.models.messages import (
        AllocationView,
        AttachNodeInput,
        NodeOperationKind,
        NodeOperationResult,
        ReplacementInput,
        ReplaceNodeRequest,
    )
    from gpucloud.workflows.allocation_steps import AllocationSteps, NodeOperation
    from gpucloud.workflows.db_steps import db_step
    from gpucloud.workflows.ledger_events import LedgerEvents


class DrainAndReplace:
    """The allocation workflow's replacement machinery.

    What the workflow uses: `report` (its `replace_node` signal), `reported` (nodes waiting to be
    pulled), `detach_failed` and `replace_all`, `drains_finished` before the run ends or
    continues as new, `replaced_any` (the membership changed), and the first provisioning's
    budget: `provision_tries_left` (None once the allocation was ready), `provision_errors`,
    `provision_failed_nodes` and `gave_up`.
    """

    def __init__(self, steps: AllocationSteps, ledger: LedgerEvents, *, cancelled: Callable[[], bool]) -> None:
        self._steps, self._ledger, self._cancelled = steps, ledger, cancelled
        self.reported: list[ReplaceNodeRequest] = []
        self.replaced_any = False
        # While the allocation is first provisioned: replacement provisions left, and every
        # provisioning failure so far (the allocation's failure reason when they run out).
        self.provision_tries_left: int | None = None
        self.provision_errors: list[str] = []
        self.provision_failed_nodes: list[str] = []
        self.gave_up = False  # the replacement provisions ran out with nodes still owed
        self._draining: list[NodeOperation] = []  # pulled nodes' drains, awaited before the run ends
        self._pulled_ids: set[str] = set()  # nodes this run took out of the allocation for a fault

    def report(self, req: ReplaceNodeRequest) -> None:
        """A node reported bad; a node already waiting to be pulled is not queued twice."""
        if all(r.node_id != req.node_id for r in self.reported):
            self.reported.append(req)

    async def detach_failed(
        self, failed: list[NodeOperationResult], view: AllocationView, *, recheck_s: float
    ) -> list[ReplaceNodeRequest]:
        owed = [
            ReplaceNodeRequest(
                node_id=r.node_id, reason=f"provisioning failed: {r.error}", immediate=True, recheck_s=recheck_s
            )
            for r in failed
        ]
        await self._steps.detach_nodes(owed)
        self.replaced_any = True
        await self._steps.remove_fabric([r.node_id for r in failed])
        # A failed provision normally took the node on through wipe and burn-in (it is available
        # again, or quarantined); one whose operation stopped short (say a deadline moved it while
        # the worker was down) is released and recycled here, so that no node is left behind.
        stranded = [r for r in failed if r.state not in ("available", "quarantined")]
        releases = [await self._steps.start_node_op(r.node_id, NodeOperationKind.RELEASE, view) for r in stranded]
        await self._steps.recycle_wiping(list(await asyncio.gather(*releases)), view)
        return owed

    async def replace_all(self, view: AllocationView, *, owed: list[ReplaceNodeRequest] | None = None) -> bool:
        """Pull every node reported bad, then replace them one by one (and the nodes in `owed`,
        already out of the allocation); whether any was pulled.

        Ends with every pulled node replaced (the last attach marks the allocation ready), or on
        cancel, when the release takes whatever the allocation holds, or, while the allocation is
        first provisioned, when the replacement provisions run out (`gave_up`).
        """
        owed = list(owed or [])  # pulled, replacement not attached yet
        pulled_any = bool(owed)
        self.gave_up = False
        waiting_noted: set[str] = set()
        fabric_noted: set[str] = set()
        while not self._cancelled():
            if self.reported:
                pulled = await self._pull_reported(view)
                owed += pulled
                pulled_any = pulled_any or bool(pulled)
                continue
            if not owed:
                break
            req = owed[0]
            if self.provision_tries_left == 0:
                self.gave_up = True
                break
            found = await db_step(
                ControlDbActivities.reserve_replacement,
                ReplacementInput(allocation_id=self._steps.allocation_id, exclude=self.provision_failed_nodes),
            )
            if found.node_id is None:
                if self.provision_tries_left is not None:
                    # First provisioning: the tenant never had the allocation, so it fails rather
                    # than hold (and bill) the nodes it has while waiting for capacity.
                    self.provision_errors.append(f"no replacement: {found.reason.split(';')[0]}")
                    self.gave_up = True
                    break
                if req.node_id not in waiting_noted:
                    await self._steps.set_status(
                        view, AllocationStatus.DEGRADED, f"node {req.node_id} pulled: {req.reason}; {found.reason}"
                    )
                    await self._steps.note("waiting_for_capacity", found.reason, req.node_id)
                    waiting_noted.add(req.node_id)
                await self._pause(req.recheck_s)
                continue
            await self._steps.note(
                "replacement_started", f"provisioning {found.node_id} to replace {req.node_id}", found.node_id
            )
            if not await self._join_fabric(found.node_id, view, note=found.node_id not in fabric_noted):
                fabric_noted.add(found.node_id)
                await self._pause(req.recheck_s)
                continue
            if self.provision_tries_left is not None:
                self.provision_tries_left -= 1
            provisioning = await self._steps.start_node_op(found.node_id, NodeOperationKind.PROVISION, view)
            provisioned = await self._pulling_while(provisioning, found.node_id, view, owed)
            if not provisioned.ok:
                await self._steps.remove_fabric([found.node_id])
                if self.provision_tries_left is not None:
                    self.provision_errors.append(f"{found.node_id}: {provisioned.error}")
                    self.provision_failed_nodes.append(found.node_id)
                    await self._steps.note(
                        "replacement_failed",
                        f"replacement {found.node_id} failed provisioning: {provisioned.error}",
                        found.node_id,
                    )
                continue  # that node goes back through wipe and burn-in; try another
            # Attached even when a cancel came meanwhile, so that the release takes it too; and
            # even when it was reported bad while provisioning: it is then pulled like any member.
            await db_step(
                ControlDbActivities.attach_node,
                AttachNodeInput(
                    allocation_id=self._steps.allocation_id,
                    node_id=found.node_id,
                    replaces=req.node_id,
                    ready=len(owed) == 1 and not self.reported,
                ),
            )
            self._ledger.node_added(view, found.node_id)
            self._pulled_ids.discard(found.node_id)  # a member again: a later fault pulls it again
            owed.pop(0)
        return pulled_any

    async def _pulling_while(
        self,
        provisioning: NodeOperation,
        node_id: str,
        view: AllocationView,
        owed: list[ReplaceNodeRequest],
    ) -> NodeOperationResult:
        """Wait for the provisioning of replacement `node_id`; a member reported bad meanwhile is
        pulled now (out of the allocation and its fabric, drained), not after it, and joins
        `owed`: a burst of faults in one allocation is pulled while its first replacement
        provisions. A report on `node_id` itself waits until it is attached, then it is pulled
        like any member."""

        def members_reported() -> bool:
            return not self._cancelled() and any(r.node_id != node_id for r in self.reported)

        while True:
            await workflow.wait_condition(lambda: provisioning.done() or members_reported())
            if provisioning.done():
                return provisioning.result()
            held = [r for r in self.reported if r.node_id == node_id]
            self.reported = [r for r in self.reported if r.node_id != node_id]
            owed += await self._pull_reported(view)
            self.reported = held + self.reported

    async def _pull_reported(self, view: AllocationView) -> list[ReplaceNodeRequest]:
        """Take every reported node out of the allocation and drain them together: at once those
        whose fault already stopped the job, the rest after the longest grace period they give
        the tenant. Returns the requests whose node was pulled (one already gone is skipped)."""
        batch, self.reported = self.reported, []
        graceful = [r for r in batch if not r.immediate and r.grace_s > 0]
        pulled = await self._detach_and_drain([r for r in batch if r not in graceful], view)
        if not graceful:
            return pulled
        for r in graceful:
            await self._steps.note(
                "fault_notice",
                f"{r.reason}; node {r.node_id} will be pulled in {r.grace_s:g} s: checkpoint now",
                r.node_id,
            )
        with contextlib.suppress(TimeoutError):
            await workflow.wait_condition(
                lambda: self._cancelled(), timeout=timedelta(seconds=max(r.grace_s for r in graceful))
            )
        if self._cancelled():
            return pulled  # the release takes the rest with the allocation
        return pulled + await self._detach_and_drain(graceful, view)

    async def _detach_and_drain(self, reqs: list[ReplaceNodeRequest], view: AllocationView) -> list[ReplaceNodeRequest]:
        # A node this run pulled already (a report repeated) is not pulled twice.
        reqs = [r for r in reqs if r.node_id not in self._pulled_ids]
        if not reqs:
            return []
        # One activity takes the reported members out and says which they were: a pull costs
        # the one worker a task less than a read of the members and then a detach.
        detached = await self._steps.detach_nodes(reqs)
        pulled = [r for r in reqs if r.node_id in detached]
        for r in pulled:
            self._pulled_ids.add(r.node_id)
            self.replaced_any = True
            self._ledger.node_removed(view, r.node_id)
        await self._steps.remove_fabric([r.node_id for r in pulled])
        # The nodes are already out of the allocation and its fabric: their replacements, and
        # the next pull, need not wait for the drains (the agents stopping what ran there).
        drains = [await self._steps.start_node_op(r.node_id, NodeOperationKind.DRAIN, view) for r in pulled]
        self._draining = [d for d in self._draining if not d.done()] + drains
        return pulled

    async def drains_finished(self) -> None:
        """Every drain started is done (a run that ends would take its child drains with it)."""
        if self._draining:
            await asyncio.gather(*self._draining)
            self._draining = []

    async def _join_fabric(self, node_id: str, view: AllocationView, *, note: bool) -> bool:
        """A reserved replacement joins the allocation's fabric membership; one that cannot goes
        back to the pool untouched by the tenant (the reservation is undone), with whatever
        membership it got taken away. Whether it joined."""
        error = await self._steps.apply_fabric(joining=[node_id])
        if error is None:
            return True
        await self._steps.remove_fabric([node_id])
        await (await self._steps.start_node_op(node_id, NodeOperationKind.RELEASE, view))
        if note:
            await self._steps.note("replacement_failed", f"replacement {node_id} not used: {error}", node_id)
        return False

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds`, or less when a cancel or another report comes."""
        with contextlib.suppress(TimeoutError):
            await workflow.wait_condition(
                lambda: self._cancelled() or bool(self.reported), timeout=timedelta(seconds=seconds)
            )
