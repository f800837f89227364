"""An allocation's life: provision its reserved gang in parallel, serve, and on cancel release.

The API reserves the gang atomically before this workflow starts (id `alloc-<allocation id>`);
the workflow then runs one child `node-<id>` workflow per node (one operation per node at a
time), marks the allocation `ready`, and waits. Cancellation is intent: the API records it in
the DB and signals; the workflow also re-reads the DB now and then, so a lost signal only delays
the cancel. It ends once every agent confirmed its node is released (`released`); the nodes'
wipe and burn-in continue in their own workflows.

Drain-and-replace (signal `replace_node`, sent by the health service): after a grace period
for the tenant to checkpoint (none when the fault already killed the job), the node leaves the
allocation (`degraded`, with the reason) and drains into quarantine through its own `node-<id>`
workflow; then a node in the same fabric domain is reserved, provisioned and attached, and the
allocation is `ready` again. With no capacity it stays `degraded` and looks again every
`recheck_s`.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from gpucloud import search_attributes as sa
    from gpucloud.models.messages import (
        AllocationEventInput,
        AllocationInput,
        AllocationProgress,
        AllocationResult,
        AllocationStatusInput,
        AllocationView,
        AttachNodeInput,
        CancelRequest,
        DetachNodeInput,
        NodeOperationInput,
        NodeOperationKind,
        NodeOperationResult,
        ReplacementInput,
        ReplacementResult,
        ReplaceNodeRequest,
    )
    from gpucloud.workflows import options
    from gpucloud.workflows.node_lifecycle import NodeOperationWorkflow, workflow_id_for

TERMINAL = ("released", "failed")
DESIRED_RECHECK = timedelta(minutes=5)
CHILD_START_RETRY = timedelta(seconds=1)


@workflow.defn
class AllocationWorkflow:
    def __init__(self) -> None:
        self._cancel_requested = False
        self._phase = "starting"
        self._nodes_total = 0
        self._nodes_done = 0
        self._allocation_id = ""
        self._replacements: list[ReplaceNodeRequest] = []
        self._replaced_any = False

    @workflow.signal
    def request_cancel(self, req: CancelRequest) -> None:
        self._cancel_requested = True

    @workflow.signal
    def replace_node(self, req: ReplaceNodeRequest) -> None:
        if all(r.node_id != req.node_id for r in self._replacements):
            self._replacements.append(req)

    @workflow.query
    def progress(self) -> AllocationProgress:
        return AllocationProgress(allocation_id=self._allocation_id, phase=self._phase,
                                  nodes_total=self._nodes_total, nodes_done=self._nodes_done,
                                  cancel_requested=self._cancel_requested)

    @workflow.run
    async def run(self, inp: AllocationInput) -> AllocationResult:
        self._allocation_id = inp.allocation_id
        view = await self._load()
        if view.status in TERMINAL:
            return AllocationResult(allocation_id=view.allocation_id, status=view.status)
        self._nodes_total = len(view.node_ids)
        if view.desired == "cancelled":
            self._cancel_requested = True

        if not self._cancel_requested and view.status in ("provisioning", "ready"):
            self._phase = "provisioning"
            results = await self._run_on_nodes(view, NodeOperationKind.PROVISION)
            failed = [r for r in results if not r.ok]
            if failed:
                reason = "; ".join(f"{r.node_id}: {r.error}" for r in failed)
                await self._release(view)
                return await self._finish(view, "failed", f"provisioning failed ({reason})")
            await self._set_status(view, "ready")

        self._phase = "ready"
        while not self._cancel_requested:
            if self._replacements and workflow.patched("drain-and-replace"):
                await self._replace(self._replacements[0], view)
                self._replacements.pop(0)
                self._phase = "ready"
                continue
            try:
                await workflow.wait_condition(lambda: self._cancel_requested or bool(self._replacements),
                                              timeout=DESIRED_RECHECK)
            except TimeoutError:
                if (await self._load()).desired == "cancelled":
                    self._cancel_requested = True
            if (not self._cancel_requested and not self._replacements
                    and workflow.info().is_continue_as_new_suggested()):
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(inp)

        if self._replaced_any:
            view = await self._load()  # the membership changed: release the nodes it has now
        await self._release(view)
        return await self._finish(view, "released", None)

    async def _replace(self, req: ReplaceNodeRequest, view: AllocationView) -> None:
        """Pull the node first, then find, provision and attach its replacement."""
        self._phase = "replacing"
        if not req.immediate and req.grace_s > 0:
            await self._note("fault_notice", f"{req.reason}; node {req.node_id} will be pulled in "
                                             f"{req.grace_s:g} s: checkpoint now", req.node_id)
            try:
                await workflow.wait_condition(lambda: self._cancel_requested, timeout=timedelta(seconds=req.grace_s))
            except TimeoutError:
                pass
            if self._cancel_requested:
                return  # the release takes the node with the rest
        before = await workflow.execute_activity(
            "load_allocation", AllocationInput(allocation_id=self._allocation_id),
            result_type=AllocationView, **options.DB)
        if req.node_id not in before.node_ids:
            return  # already pulled (a repeated signal)
        await workflow.execute_activity(
            "detach_node", DetachNodeInput(allocation_id=self._allocation_id, node_id=req.node_id,
                                           reason=req.reason), result_type=AllocationView, **options.DB)
        self._replaced_any = True
        drain = await self._start_node_op(req.node_id, NodeOperationKind.DRAIN, view)
        await drain
        waiting_noted = False
        while not self._cancel_requested:
            found = await workflow.execute_activity(
                "reserve_replacement", ReplacementInput(allocation_id=self._allocation_id),
                result_type=ReplacementResult, **options.DB)
            if found.node_id is None:
                if not waiting_noted:
                    await self._set_status(view, "degraded", f"node {req.node_id} pulled: {req.reason}; "
                                                             f"{found.reason}")
                    await self._note("waiting_for_capacity", found.reason, req.node_id)
                    waiting_noted = True
                try:
                    await workflow.wait_condition(lambda: self._cancel_requested,
                                                  timeout=timedelta(seconds=req.recheck_s))
                except TimeoutError:
                    pass
                continue
            await self._note("replacement_started", f"provisioning {found.node_id} to replace {req.node_id}",
                             found.node_id)
            provisioned = await (await self._start_node_op(found.node_id, NodeOperationKind.PROVISION, view))
            if not provisioned.ok:
                continue  # that node goes back through wipe and burn-in; try another
            # Attached even when a cancel came meanwhile, so that the release takes it too.
            await workflow.execute_activity(
                "attach_node", AttachNodeInput(allocation_id=self._allocation_id, node_id=found.node_id,
                                               replaces=req.node_id, ready=len(self._replacements) <= 1),
                result_type=AllocationView, **options.DB)
            return

    async def _note(self, kind: str, reason: str, node_id: str | None = None) -> None:
        await workflow.execute_activity(
            "record_allocation_event",
            AllocationEventInput(allocation_id=self._allocation_id, kind=kind, reason=reason, node_id=node_id),
            **options.DB)

    async def _release(self, view: AllocationView) -> None:
        """Release every node (the agents confirm the tenant is off), then start their recycling."""
        self._phase = "releasing"
        self._nodes_done = 0
        results = await self._run_on_nodes(view, NodeOperationKind.RELEASE)
        for result in results:
            if result.state == "wiping":
                # Wipe and burn-in take long and are the node's business, not the tenant's:
                # they continue after this workflow ends.
                await self._start_node_op(result.node_id, NodeOperationKind.RECYCLE, view,
                                          parent_close_policy=ParentClosePolicy.ABANDON)

    async def _finish(self, view: AllocationView, status: str, reason: str | None) -> AllocationResult:
        self._phase = status
        await self._set_status(view, status, reason)
        return AllocationResult(allocation_id=view.allocation_id, status=status, failure_reason=reason)

    async def _run_on_nodes(self, view: AllocationView, op: NodeOperationKind) -> list[NodeOperationResult]:
        async def one(node_id: str) -> NodeOperationResult:
            handle = await self._start_node_op(node_id, op, view)
            result = await handle
            self._nodes_done += 1
            return result

        return list(await asyncio.gather(*(one(n) for n in view.node_ids)))

    async def _start_node_op(self, node_id: str, op: NodeOperationKind, view: AllocationView,
                             *, parent_close_policy: ParentClosePolicy = ParentClosePolicy.TERMINATE):
        # The node's previous workflow (say, bring-up) may still be closing: wait for it, since
        # one node runs one operation at a time.
        while True:
            try:
                return await workflow.start_child_workflow(
                    NodeOperationWorkflow.run,
                    NodeOperationInput(node_id=node_id, operation=op, allocation_id=view.allocation_id,
                                       tenant_id=view.tenant_id),
                    id=workflow_id_for(node_id),
                    parent_close_policy=parent_close_policy,
                    search_attributes=sa.typed((sa.NODE_ID, node_id), (sa.ALLOCATION_ID, view.allocation_id),
                                               (sa.TENANT_ID, view.tenant_id)),
                )
            except WorkflowAlreadyStartedError:
                await workflow.sleep(CHILD_START_RETRY)

    async def _load(self) -> AllocationView:
        return await workflow.execute_activity(
            "load_allocation", AllocationInput(allocation_id=self._allocation_id),
            result_type=AllocationView, **options.DB)

    async def _set_status(self, view: AllocationView, status: str, reason: str | None = None) -> None:
        await workflow.execute_activity(
            "set_allocation_status",
            AllocationStatusInput(allocation_id=view.allocation_id, status=status, failure_reason=reason),
            result_type=AllocationView, **options.DB)
