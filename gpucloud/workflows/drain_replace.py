"""Drain-and-replace inside an allocation workflow: pull nodes reported bad out of the allocation
and its fabric, drain them, and provision replacements from the same fabric domain.

A mixin of `AllocationWorkflow` (its state lives on the workflow), kept in its own module since
it is a process of its own. Several failed nodes (a burst) are all pulled first, together, then
replaced one after another; a node reported while a replacement provisions is pulled at once,
not after it; a pulled node's drain runs behind its replacement and is awaited before the run
ends. A node reported while the allocation is still provisioning is replaced before the
allocation is first `ready`, so the tenant is never handed a node known to be bad; a node that
fails provisioning is replaced the same way, at most `provision_retries` times.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, WorkflowAlreadyStartedError
from temporalio.workflow import ChildWorkflowHandle, ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from gpucloud.activities.control_db import ControlDbActivities
    from gpucloud.activities.fabric import FabricActivities
    from gpucloud.models import search_attributes as sa
    from gpucloud.models.fabric_messages import FabricApplyInput, FabricRemoveInput
    from gpucloud.models.messages import (
        AllocationEventInput,
        AllocationInput,
        AllocationStatusInput,
        AllocationView,
        AttachNodeInput,
        DetachNodeInput,
        DetachNodesInput,
        NodeOperationInput,
        NodeOperationKind,
        NodeOperationResult,
        ReplacementInput,
        ReplaceNodeRequest,
    )
    from gpucloud.models.workflow_ids import node_workflow_id
    from gpucloud.workflows import options
    from gpucloud.workflows.ledger_events import LedgerEvents
    from gpucloud.workflows.node_lifecycle import NodeOperationWorkflow

CHILD_START_RETRY = timedelta(seconds=1)


class DrainAndReplace:
    """The allocation workflow's replacement machinery and its per-node operations."""

    _allocation_id: str
    _cancel_requested: bool
    _phase: str
    _replacements: list[ReplaceNodeRequest]
    _replaced_any: bool
    _ledger: LedgerEvents
    _provision_tries_left: int | None
    _provision_errors: list[str]
    _provision_failed_nodes: list[str]
    _gave_up: bool
    _draining: list[ChildWorkflowHandle[NodeOperationWorkflow, NodeOperationResult]]
    _pulled_ids: set[str]

    async def _detach_failed(
        self, failed: list[NodeOperationResult], view: AllocationView, *, recheck_s: float
    ) -> list[ReplaceNodeRequest]:
        owed = [
            ReplaceNodeRequest(
                node_id=r.node_id, reason=f"provisioning failed: {r.error}", immediate=True, recheck_s=recheck_s
            )
            for r in failed
        ]
        await self._detach_nodes(owed)
        self._replaced_any = True
        await self._remove_fabric([r.node_id for r in failed])
        # A failed provision normally took the node on through wipe and burn-in (it is available
        # again, or quarantined); one whose operation stopped short (say a deadline moved it while
        # the worker was down) is released and recycled here, so that no node is left behind.
        stranded = [r for r in failed if r.state not in ("available", "quarantined")]
        releases = [await self._start_node_op(r.node_id, NodeOperationKind.RELEASE, view) for r in stranded]
        await self._recycle_wiping(list(await asyncio.gather(*releases)), view)
        return owed

    async def _replace_all(self, view: AllocationView, *, owed: list[ReplaceNodeRequest] | None = None) -> bool:
        """Pull every node reported bad, then replace them one by one (and the nodes in `owed`,
        already out of the allocation); whether any was pulled.

        Ends with every pulled node replaced (the last attach marks the allocation ready), or on
        cancel, when the release takes whatever the allocation holds, or, while the allocation is
        first provisioned, when the replacement provisions run out (`_gave_up`).
        """
        self._phase = "replacing"
        owed = list(owed or [])  # pulled, replacement not attached yet
        pulled_any = bool(owed)
        self._gave_up = False
        waiting_noted: set[str] = set()
        fabric_noted: set[str] = set()
        while not self._cancel_requested:
            if self._replacements:
                pulled = await self._pull_reported(view)
                owed += pulled
                pulled_any = pulled_any or bool(pulled)
                continue
            if not owed:
                break
            req = owed[0]
            if self._provision_tries_left == 0:
                self._gave_up = True
                break
            found = await workflow.execute_activity_method(
                ControlDbActivities.reserve_replacement,
                ReplacementInput(allocation_id=self._allocation_id, exclude=self._provision_failed_nodes),
                **options.DB,
            )
            if found.node_id is None:
                if self._provision_tries_left is not None:
                    # First provisioning: the tenant never had the allocation, so it fails rather
                    # than hold (and bill) the nodes it has while waiting for capacity.
                    self._provision_errors.append(f"no replacement: {found.reason.split(';')[0]}")
                    self._gave_up = True
                    break
                if req.node_id not in waiting_noted:
                    await self._set_status(view, "degraded", f"node {req.node_id} pulled: {req.reason}; {found.reason}")
                    await self._note("waiting_for_capacity", found.reason, req.node_id)
                    waiting_noted.add(req.node_id)
                await self._pause(req.recheck_s)
                continue
            await self._note(
                "replacement_started", f"provisioning {found.node_id} to replace {req.node_id}", found.node_id
            )
            if not await self._join_fabric(found.node_id, view, note=found.node_id not in fabric_noted):
                fabric_noted.add(found.node_id)
                await self._pause(req.recheck_s)
                continue
            if self._provision_tries_left is not None:
                self._provision_tries_left -= 1
            provisioning = await self._start_node_op(found.node_id, NodeOperationKind.PROVISION, view)
            provisioned = await self._pulling_while(provisioning, found.node_id, view, owed)
            if not provisioned.ok:
                await self._remove_fabric([found.node_id])
                if self._provision_tries_left is not None:
                    self._provision_errors.append(f"{found.node_id}: {provisioned.error}")
                    self._provision_failed_nodes.append(found.node_id)
                    await self._note(
                        "replacement_failed",
                        f"replacement {found.node_id} failed provisioning: {provisioned.error}",
                        found.node_id,
                    )
                continue  # that node goes back through wipe and burn-in; try another
            # Attached even when a cancel came meanwhile, so that the release takes it too; and
            # even when it was reported bad while provisioning: it is then pulled like any member.
            await workflow.execute_activity_method(
                ControlDbActivities.attach_node,
                AttachNodeInput(
                    allocation_id=self._allocation_id,
                    node_id=found.node_id,
                    replaces=req.node_id,
                    ready=len(owed) == 1 and not self._replacements,
                ),
                **options.DB,
            )
            self._ledger.node_added(view, found.node_id)
            self._pulled_ids.discard(found.node_id)  # a member again: a later fault pulls it again
            owed.pop(0)
        return pulled_any

    async def _pulling_while(
        self,
        provisioning: ChildWorkflowHandle[NodeOperationWorkflow, NodeOperationResult],
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
            return not self._cancel_requested and any(r.node_id != node_id for r in self._replacements)

        while True:
            await workflow.wait_condition(lambda: provisioning.done() or members_reported())
            if provisioning.done():
                return provisioning.result()
            held = [r for r in self._replacements if r.node_id == node_id]
            self._replacements = [r for r in self._replacements if r.node_id != node_id]
            owed += await self._pull_reported(view)
            self._replacements = held + self._replacements

    async def _pull_reported(self, view: AllocationView) -> list[ReplaceNodeRequest]:
        """Take every reported node out of the allocation and drain them together: at once those
        whose fault already stopped the job, the rest after the longest grace period they give
        the tenant. Returns the requests whose node was pulled (one already gone is skipped)."""
        batch, self._replacements = self._replacements, []
        graceful = [r for r in batch if not r.immediate and r.grace_s > 0]
        pulled = await self._detach_and_drain([r for r in batch if r not in graceful], view)
        if not graceful:
            return pulled
        for r in graceful:
            await self._note(
                "fault_notice",
                f"{r.reason}; node {r.node_id} will be pulled in {r.grace_s:g} s: checkpoint now",
                r.node_id,
            )
        with contextlib.suppress(TimeoutError):
            await workflow.wait_condition(
                lambda: self._cancel_requested, timeout=timedelta(seconds=max(r.grace_s for r in graceful))
            )
        if self._cancel_requested:
            return pulled  # the release takes the rest with the allocation
        return pulled + await self._detach_and_drain(graceful, view)

    async def _detach_and_drain(self, reqs: list[ReplaceNodeRequest], view: AllocationView) -> list[ReplaceNodeRequest]:
        # A node this run pulled already (a report repeated) is not pulled twice.
        reqs = [r for r in reqs if r.node_id not in self._pulled_ids]
        if not reqs:
            return []
        # One activity takes the reported members out and says which they were: a pull costs
        # the one worker a task less than a read of the members and then a detach.
        detached = await self._detach_nodes(reqs)
        pulled = [r for r in reqs if r.node_id in detached]
        for r in pulled:
            self._pulled_ids.add(r.node_id)
            self._replaced_any = True
            self._ledger.node_removed(view, r.node_id)
        await self._remove_fabric([r.node_id for r in pulled])
        # The nodes are already out of the allocation and its fabric: their replacements, and
        # the next pull, need not wait for the drains (the agents stopping what ran there).
        drains = [await self._start_node_op(r.node_id, NodeOperationKind.DRAIN, view) for r in pulled]
        self._draining = [d for d in self._draining if not d.done()] + drains
        return pulled

    async def _drains_finished(self) -> None:
        """Every drain started is done (a run that ends would take its child drains with it)."""
        if self._draining:
            await asyncio.gather(*self._draining)
            self._draining = []

    async def _apply_fabric(self, *, joining: list[str] | None = None) -> str | None:
        """Apply the allocation's fabric membership (its nodes, and `joining`) and read it back;
        None once it holds, else why it could not be applied."""
        try:
            await workflow.execute_activity_method(
                FabricActivities.apply_allocation_fabric,
                FabricApplyInput(allocation_id=self._allocation_id, joining=joining or []),
                **options.FABRIC_APPLY,
            )
        except ActivityError as err:
            # The details may name other allocations' partitions: they go to the operator's log
            # (and the history), the tenant sees what kind of failure it was.
            workflow.logger.warning("fabric membership of %s not applied: %s", self._allocation_id, _failure_chain(err))
            return f"fabric isolation could not be applied and verified ({_failure_kind(err)}); nothing was kept"
        return None

    async def _remove_fabric(self, node_ids: list[str]) -> None:
        if node_ids:
            await workflow.execute_activity_method(
                FabricActivities.remove_allocation_fabric_nodes,
                FabricRemoveInput(allocation_id=self._allocation_id, node_ids=node_ids),
                **options.FABRIC_REMOVE,
            )

    async def _join_fabric(self, node_id: str, view: AllocationView, *, note: bool) -> bool:
        """A reserved replacement joins the allocation's fabric membership; one that cannot goes
        back to the pool untouched by the tenant (the reservation is undone), with whatever
        membership it got taken away. Whether it joined."""
        error = await self._apply_fabric(joining=[node_id])
        if error is None:
            return True
        await self._remove_fabric([node_id])
        await (await self._start_node_op(node_id, NodeOperationKind.RELEASE, view))
        if note:
            await self._note("replacement_failed", f"replacement {node_id} not used: {error}", node_id)
        return False

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds`, or less when a cancel or another report comes."""
        with contextlib.suppress(TimeoutError):
            await workflow.wait_condition(
                lambda: self._cancel_requested or bool(self._replacements), timeout=timedelta(seconds=seconds)
            )

    async def _start_node_op(
        self,
        node_id: str,
        op: NodeOperationKind,
        view: AllocationView,
        *,
        parent_close_policy: ParentClosePolicy = ParentClosePolicy.TERMINATE,
    ) -> ChildWorkflowHandle[NodeOperationWorkflow, NodeOperationResult]:
        # The node's previous workflow (say, bring-up) may still be closing: wait for it, since
        # one node runs one operation at a time.
        while True:
            try:
                return await workflow.start_child_workflow(
                    NodeOperationWorkflow.run,
                    NodeOperationInput(
                        node_id=node_id,
                        operation=op,
                        allocation_id=view.allocation_id,
                        tenant_id=view.tenant_id,
                        workload=view.workload
                        if op in (NodeOperationKind.PROVISION, NodeOperationKind.RESTORE)
                        else None,
                    ),
                    id=node_workflow_id(node_id),
                    parent_close_policy=parent_close_policy,
                    search_attributes=sa.typed(
                        (sa.NODE_ID, node_id), (sa.ALLOCATION_ID, view.allocation_id), (sa.TENANT_ID, view.tenant_id)
                    ),
                )
            except WorkflowAlreadyStartedError:
                await workflow.sleep(CHILD_START_RETRY)

    async def _recycle_wiping(self, results: list[NodeOperationResult], view: AllocationView) -> None:
        for result in results:
            if result.state == "wiping":
                # Wipe and burn-in take long and are the node's business, not the tenant's:
                # they continue after this workflow ends.
                await self._start_node_op(
                    result.node_id, NodeOperationKind.RECYCLE, view, parent_close_policy=ParentClosePolicy.ABANDON
                )

    async def _detach_nodes(self, reqs: list[ReplaceNodeRequest]) -> list[str]:
        """The requests' nodes out of the allocation, in one activity; the ones it pulled."""
        nodes = [
            DetachNodeInput(allocation_id=self._allocation_id, node_id=r.node_id, reason=r.reason, fault_at=r.fault_at)
            for r in reqs
        ]
        result = await workflow.execute_activity_method(
            ControlDbActivities.detach_nodes,
            DetachNodesInput(allocation_id=self._allocation_id, nodes=nodes),
            **options.DB,
        )
        return result.pulled

    async def _note(self, kind: str, reason: str, node_id: str | None = None) -> None:
        await workflow.execute_activity_method(
            ControlDbActivities.record_allocation_event,
            AllocationEventInput(allocation_id=self._allocation_id, kind=kind, reason=reason, node_id=node_id),
            **options.DB,
        )

    async def _load(self) -> AllocationView:
        return await workflow.execute_activity_method(
            ControlDbActivities.load_allocation, AllocationInput(allocation_id=self._allocation_id), **options.DB
        )

    async def _set_status(self, view: AllocationView, status: str, reason: str | None = None) -> None:
        await workflow.execute_activity_method(
            ControlDbActivities.set_allocation_status,
            AllocationStatusInput(allocation_id=view.allocation_id, status=status, failure_reason=reason),
            **options.DB,
        )


def _failure_kind(err: ActivityError) -> str:
    kinds = {"FabricRefused": "a fabric manager refused", "FabricMismatch": "the read-back differed"}
    cause = err.__cause__
    while cause is not None and not isinstance(cause, ApplicationError):
        cause = cause.__cause__  # a timeout carries the last attempt's error, if it had one
    if cause is None:
        return "the fabric managers did not answer in time"
    return kinds.get(cause.type or "", "a fabric manager failed")


def _failure_chain(err: BaseException) -> str:
    """The messages of an activity failure's causes (a timeout names the last attempt's error)."""
    messages = []
    cause = err.__cause__
    while cause is not None:
        messages.append(getattr(cause, "message", None) or str(cause))
        cause = cause.__cause__
    return ": ".join(messages) or str(err)
