"""An allocation's life: apply its fabric slice, provision its reserved gang in parallel, serve,
replace nodes that fail, and on cancel release.

The API reserves the gang atomically before this workflow starts (id `alloc-<allocation id>`).
Before any node is provisioned, the allocation's fabric membership (its pkey, one NVLink
partition per NVL72 domain, the tenant's VPC) is applied and read back, so a node is `active`
only on its own tenant's fabrics; a manager that stays down or refuses fails the allocation
closed. The workflow then runs one child `node-<id>` workflow per node (one operation per node
at a time), marks the allocation `ready`, and waits. Cancellation is intent: the API records it
in the DB and signals; the workflow also re-reads the DB now and then, so a lost signal only
delays the cancel. It ends once every agent confirmed its node is released (`released`); the
nodes' wipe and burn-in continue in their own workflows.

Drain-and-replace (signal `replace_node`, sent by the health service) is a collaborator in
`drain_replace.py`, and the steps both take on the world (activities, node operations) are in
`allocation_steps.py`: after a grace period for the tenant to checkpoint (none when the fault
already killed the job), the node leaves the allocation (`degraded`, with the reason) and its
fabric, and drains into quarantine; a node of the same fabric domain joins and is provisioned in
its place. With no capacity the allocation stays `degraded` and looks again every `recheck_s`.
The release takes the membership away before the nodes are released to be wiped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from gpucloud.models.allocation_states import TERMINAL_ALLOCATION, AllocationStatus
    from gpucloud.models.messages import (
        AllocationInput,
        AllocationProgress,
        AllocationResult,
        AllocationView,
        CancelRequest,
        NodeOperationKind,
        NodeOperationResult,
        PreemptRequest,
        ReplaceNodeRequest,
    )
    from gpucloud.workflows.allocation_steps import AllocationSteps
    from gpucloud.workflows.drain_replace import DrainAndReplace
    from gpucloud.workflows.ledger_events import LedgerEvents

DESIRED_RECHECK = timedelta(minutes=5)


@workflow.defn
class AllocationWorkflow:
    def __init__(self) -> None:
        self._cancel_requested = False
        self._placed = False
        self._preempt: PreemptRequest | None = None
        self._phase = "starting"
        self._nodes_total = 0
        self._nodes_done = 0
        self._ledger = LedgerEvents()
        self._steps = AllocationSteps()
        self._drain = DrainAndReplace(self._steps, self._ledger, cancelled=lambda: self._cancel_requested)

    @workflow.signal
    def request_cancel(self, req: CancelRequest) -> None:
        self._cancel_requested = True

    @workflow.signal
    def placed(self) -> None:
        self._placed = True

    @workflow.signal
    def preempt(self, req: PreemptRequest) -> None:
        if self._preempt is None:  # the first notice counts; the scheduler repeats it until the release
            self._preempt = req

    @workflow.signal
    def replace_node(self, req: ReplaceNodeRequest) -> None:
        self._drain.report(req)

    @workflow.query
    def progress(self) -> AllocationProgress:
        return AllocationProgress(
            allocation_id=self._steps.allocation_id,
            phase=self._phase,
            nodes_total=self._nodes_total,
            nodes_done=self._nodes_done,
            cancel_requested=self._cancel_requested,
        )

    @workflow.run
    async def run(self, inp: AllocationInput) -> AllocationResult:
        self._steps.allocation_id = inp.allocation_id
        view = await self._steps.load()
        # `queued_before`: a run continued as new from the queue, whose row may have moved on
        # (a cancel read here must not be taken for an allocation that held nodes).
        if view.status == AllocationStatus.QUEUED or inp.queued_before:
            view = await self._wait_in_queue(inp)
            if view.status == AllocationStatus.CANCELLING and not view.node_ids:
                # Cancelled while queued: it never held a node, so nothing is billed or released.
                await self._steps.set_status(view, AllocationStatus.RELEASED)
                self._phase = AllocationStatus.RELEASED
                return AllocationResult(allocation_id=view.allocation_id, status=AllocationStatus.RELEASED)
        if view.status in TERMINAL_ALLOCATION:
            return AllocationResult(allocation_id=view.allocation_id, status=view.status)
        self._nodes_total = len(view.node_ids)
        if view.desired == "cancelled":
            self._cancel_requested = True
        # A run continued as new finds the allocation ready, its membership applied by the first.
        if not self._cancel_requested and view.status == AllocationStatus.PROVISIONING:
            failure = await self._provision(view, inp)
            if failure is not None:
                current = await self._steps.load()  # the release takes what it holds now
                await self._release(current)
                return await self._finish(current, AllocationStatus.FAILED, failure)

        self._phase = "ready"
        while not self._cancel_requested:
            if self._preempt is not None:
                await self._preempted(view, self._preempt)
                continue
            if self._drain.reported:
                await self._replace_all(view)
                self._phase = "ready"
                continue
            try:
                await workflow.wait_condition(
                    lambda: self._cancel_requested or bool(self._drain.reported) or self._preempt is not None,
                    timeout=DESIRED_RECHECK,
                )
            except TimeoutError:
                if (await self._steps.load()).desired == "cancelled":
                    self._cancel_requested = True
            if (
                not self._cancel_requested
                and not self._drain.reported
                and workflow.info().is_continue_as_new_suggested()
            ):
                await workflow.wait_condition(workflow.all_handlers_finished)
                await self._ledger.flushed()
                await self._drain.drains_finished()
                workflow.continue_as_new(inp)

        if self._drain.replaced_any:
            view = await self._steps.load()  # the membership changed: release the nodes it has now
        await self._release(view)
        return await self._finish(view, AllocationStatus.RELEASED, None)

    async def _preempted(self, view: AllocationView, req: PreemptRequest) -> None:
        """Taken back (`services/scheduling.py`): the tenant had its notice (an event); when it ends,
        the allocation is released as a cancel is (the agents stop the workload: SIGTERM, then their
        grace period)."""
        self._phase = "preempting"
        left = (req.stop_at - workflow.now()).total_seconds()
        if left > 0:
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(lambda: self._cancel_requested, timeout=timedelta(seconds=left))
        if not self._cancel_requested:
            await self._steps.note("preempted", req.reason)
            await self._steps.set_status(view, AllocationStatus.CANCELLING)
        self._cancel_requested = True

    async def _wait_in_queue(self, inp: AllocationInput) -> AllocationView:
        """Queued in its pool (`services/scheduling.py`): make sure the pool's scheduler runs, and
        wait until it placed the allocation (nodes reserved), expired it, or it was cancelled; the
        row is read again at each signal and every `queue_recheck_s` (a lost signal only delays).

        The scheduler is asked to plan at once when the request joins the queue; a recheck only
        makes sure it runs (it plans on its own round while anything is queued). A request queued
        for days continues as new when Temporal suggests it: the new run reads the row first."""
        self._phase = AllocationStatus.QUEUED
        recheck = timedelta(seconds=inp.queue_recheck_s)
        scheduler_told = inp.queued_before
        while True:
            self._placed = False
            cancelled_before = self._cancel_requested
            view = await self._steps.load()
            if view.status != AllocationStatus.QUEUED:
                return view
            scheduler_told = await self._steps.ensure_scheduler(view, plan_now=not scheduler_told) or scheduler_told
            moved = functools.partial(self._moved_in_queue, cancelled_before)
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(moved, timeout=recheck)
            if not moved() and workflow.info().is_continue_as_new_suggested():
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(inp.model_copy(update={"queued_before": scheduler_told}))

    def _moved_in_queue(self, cancelled_before: bool) -> bool:
        return self._placed or self._cancel_requested != cancelled_before

    async def _provision(self, view: AllocationView, inp: AllocationInput) -> str | None:
        """Fabric first, then every node; the allocation is `ready` once all are provisioned
        (nodes that failed, or were reported bad meanwhile, replaced first). None on success,
        else why the allocation failed."""
        self._phase = "fabric"
        fabric_error = await self._steps.apply_fabric()
        if fabric_error is not None:
            self._ledger.started(view, [])
            return fabric_error
        self._phase = "provisioning"
        results = await self._provision_nodes(view)
        if self._cancel_requested:
            # Cancelled before it was ever ready: the tenant held nothing, so nothing is billed
            # (the ledger learns of an allocation without nodes); the release takes what
            # provisioned meanwhile.
            self._ledger.started(view, [])
            return None
        failed = [r for r in results if not r.ok]
        self._drain.provision_errors = [f"{r.node_id}: {r.error}" for r in failed]
        self._drain.provision_failed_nodes = [r.node_id for r in failed]
        if failed and (self._cancel_requested or len(failed) > inp.provision_retries):
            self._ledger.started(view, [])
            return self._provision_failure()
        if failed:
            # A node that failed provisioning is already on its way back to the pool (wipe,
            # burn-in); another takes its place, as for a node pulled by the health loop.
            self._drain.provision_tries_left = inp.provision_retries
            owed = await self._drain.detach_failed(failed, view, recheck_s=inp.replacement_recheck_s)
            await self._replace_all(view, owed=owed)
            self._drain.provision_tries_left = None
            if self._drain.gave_up:
                self._ledger.started(view, [])
                return self._provision_failure()
        # A node reported bad while provisioning is replaced first; the last attach marks the
        # allocation ready.
        replaced_first = bool(failed) or (bool(self._drain.reported) and await self._replace_all(view))
        if not replaced_first:
            await self._steps.set_status(view, AllocationStatus.READY)
        # Billing starts now that the tenant has the allocation: the nodes provisioned first count
        # from here, replacements from their attach (a moment ago; the ledger clips them to here).
        # A first node pulled before ready is not the tenant's any more.
        members = [r.node_id for r in results if r.ok]
        if replaced_first:
            current = set((await self._steps.load()).node_ids)  # one read, not one per node
            members = [node for node in members if node in current]
        self._ledger.started(view, members)
        return None

    async def _replace_all(self, view: AllocationView, *, owed: list[ReplaceNodeRequest] | None = None) -> bool:
        self._phase = "replacing"
        return await self._drain.replace_all(view, owed=owed)

    def _provision_failure(self) -> str:
        return f"provisioning failed ({'; '.join(self._drain.provision_errors)})"

    async def _release(self, view: AllocationView) -> None:
        """Release every node (the agents confirm the tenant is off), then start their recycling."""
        self._phase = "releasing"
        self._nodes_done = 0
        self._ledger.releasing()
        # Off the fabrics first: no path to the tenant is left once its nodes are recycled.
        await self._steps.release_fabric()
        await self._steps.recycle_wiping(await self._run_on_nodes(view, NodeOperationKind.RELEASE), view)

    async def _finish(self, view: AllocationView, status: AllocationStatus, reason: str | None) -> AllocationResult:
        await self._drain.drains_finished()
        self._phase = status
        await self._steps.set_status(view, status, reason)
        self._ledger.ended(view)
        await self._ledger.flushed()
        return AllocationResult(allocation_id=view.allocation_id, status=status, failure_reason=reason)

    async def _provision_nodes(self, view: AllocationView) -> list[NodeOperationResult]:
        """Provision every node at once; a cancel meanwhile stops every provision still under way
        (each node goes back to the pool through wipe and burn-in) and waits for them to stop."""
        handles: list[workflow.ChildWorkflowHandle] = []

        async def one(node_id: str) -> NodeOperationResult:
            handle = await self._steps.start_node_op(node_id, NodeOperationKind.PROVISION, view)
            handles.append(handle)
            result = await handle
            self._nodes_done += 1
            return result

        provisioning = asyncio.gather(*(one(n) for n in view.node_ids))
        await workflow.wait_condition(lambda: provisioning.done() or self._cancel_requested)
        if not provisioning.done():
            await workflow.wait_condition(lambda: len(handles) == len(view.node_ids))  # every start answered
            for handle in handles:
                handle.cancel()
        return list(await provisioning)

    async def _run_on_nodes(self, view: AllocationView, op: NodeOperationKind) -> list[NodeOperationResult]:
        async def one(node_id: str) -> NodeOperationResult:
            handle = await self._steps.start_node_op(node_id, op, view)
            result = await handle
            self._nodes_done += 1
            return result

        return list(await asyncio.gather(*(one(n) for n in view.node_ids)))
