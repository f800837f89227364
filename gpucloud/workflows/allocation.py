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

Several failed nodes (a burst) are all pulled first, together, and then replaced one after
another; a node reported while replacements are under way is pulled before the next one is
reserved. A node reported while the allocation is still provisioning is replaced before the
allocation is first marked `ready`, so the tenant is never handed a node known to be bad.

Fabric isolation (patch `fabric-membership`): before any node is provisioned, the allocation's
membership (its pkey, one NVLink partition per NVL72 domain, the tenant's VPC) is applied and
read back, so a node is `active` only on its own tenant's fabrics; a manager that stays down or
refuses fails the allocation closed. A pulled node leaves the membership before it drains, a
replacement joins before it is provisioned, and the release takes the membership away before
the nodes are released to be wiped.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, WorkflowAlreadyStartedError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from gpucloud.models.fabric_messages import (
        FabricApplyInput,
        FabricMembershipResult,
        FabricReleaseInput,
        FabricRemoveInput,
    )
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
    from gpucloud.workflows import search_attributes as sa
    from gpucloud.workflows.ledger_events import LedgerEvents
    from gpucloud.workflows.node_lifecycle import NodeOperationWorkflow, workflow_id_for

TERMINAL = ("released", "failed")
DESIRED_RECHECK = timedelta(minutes=5)
CHILD_START_RETRY = timedelta(seconds=1)
# Histories recorded before fabric membership was wired in replay without its activities.
FABRIC_PATCH = "fabric-membership"
# Histories recorded before nodes that fail provisioning were replaced fail the allocation instead.
PROVISION_REPLACE_PATCH = "replace-failed-provision"
# Histories recorded before nodes reported while a replacement provisions were pulled at once
# wait for that replacement first.
PULL_WHILE_REPLACING_PATCH = "pull-while-replacing"
# Histories recorded before a pulled node's drain ran behind its replacement wait for the drain.
DRAIN_BEHIND_PATCH = "drain-behind-replacement"


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
        self._ledger = LedgerEvents()
        # While the allocation is first provisioned: replacement provisions left, and every
        # provisioning failure so far (the allocation's failure reason when they run out).
        self._provision_tries_left: int | None = None
        self._provision_errors: list[str] = []
        self._provision_failed_nodes: list[str] = []
        self._gave_up = False  # the replacement provisions ran out with nodes still owed
        self._draining: list[asyncio.Task] = []  # pulled nodes' drains, awaited before the run ends

    @workflow.signal
    def request_cancel(self, req: CancelRequest) -> None:
        self._cancel_requested = True

    @workflow.signal
    def replace_node(self, req: ReplaceNodeRequest) -> None:
        if all(r.node_id != req.node_id for r in self._replacements):
            self._replacements.append(req)

    @workflow.query
    def progress(self) -> AllocationProgress:
        return AllocationProgress(
            allocation_id=self._allocation_id,
            phase=self._phase,
            nodes_total=self._nodes_total,
            nodes_done=self._nodes_done,
            cancel_requested=self._cancel_requested,
        )

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
            # A run continued as new finds the allocation ready, its membership applied by the first.
            if view.status == "provisioning" and workflow.patched(FABRIC_PATCH):
                self._phase = "fabric"
                fabric_error = await self._apply_fabric()
                if fabric_error is not None:
                    self._ledger.started(view, [])
                    await self._release(view)
                    return await self._finish(view, "failed", fabric_error)
            self._phase = "provisioning"
            results = await self._run_on_nodes(view, NodeOperationKind.PROVISION)
            self._ledger.started(view, [r.node_id for r in results if r.ok])
            failed = [r for r in results if not r.ok]
            self._provision_errors = [f"{r.node_id}: {r.error}" for r in failed]
            self._provision_failed_nodes = [r.node_id for r in failed]
            replacing_failed = (
                bool(failed)
                and not self._cancel_requested
                and workflow.patched(PROVISION_REPLACE_PATCH)
                and len(failed) <= inp.provision_retries
            )
            if failed and not replacing_failed:
                await self._release(view)
                return await self._finish(view, "failed", self._provision_failure())
            if replacing_failed:
                # A node that failed provisioning is already on its way back to the pool (wipe,
                # burn-in); another takes its place, as for a node pulled by the health loop.
                self._provision_tries_left = inp.provision_retries
                owed = await self._detach_failed(failed, view, recheck_s=inp.replacement_recheck_s)
                await self._replace_all(view, owed=owed)
                self._provision_tries_left = None
                if self._gave_up:
                    current = await self._load()  # the release takes what it holds now
                    await self._release(current)
                    return await self._finish(current, "failed", self._provision_failure())
            # A node reported bad while provisioning is replaced first; the last attach marks
            # the allocation ready.
            replaced_first = replacing_failed or (
                bool(self._replacements) and workflow.patched("replace-before-ready") and await self._replace_all(view)
            )
            if not replaced_first:
                await self._set_status(view, "ready")

        self._phase = "ready"
        while not self._cancel_requested:
            if self._replacements and workflow.patched("drain-and-replace"):
                if workflow.patched("replace-in-bursts"):
                    await self._replace_all(view)
                else:
                    await self._replace(self._replacements[0], view)
                    self._replacements.pop(0)
                self._phase = "ready"
                continue
            try:
                await workflow.wait_condition(
                    lambda: self._cancel_requested or bool(self._replacements), timeout=DESIRED_RECHECK
                )
            except TimeoutError:
                if (await self._load()).desired == "cancelled":
                    self._cancel_requested = True
            if not self._cancel_requested and not self._replacements and workflow.info().is_continue_as_new_suggested():
                await workflow.wait_condition(workflow.all_handlers_finished)
                await self._ledger.flushed()
                await self._drains_finished()
                workflow.continue_as_new(inp)

        if self._replaced_any:
            view = await self._load()  # the membership changed: release the nodes it has now
        await self._release(view)
        return await self._finish(view, "released", None)

    def _provision_failure(self) -> str:
        return f"provisioning failed ({'; '.join(self._provision_errors)})"

    async def _detach_failed(
        self, failed: list[NodeOperationResult], view: AllocationView, *, recheck_s: float
    ) -> list[ReplaceNodeRequest]:
        owed = []
        for r in failed:
            reason = f"provisioning failed: {r.error}"
            await workflow.execute_activity(
                "detach_node",
                DetachNodeInput(allocation_id=self._allocation_id, node_id=r.node_id, reason=reason),
                result_type=AllocationView,
                **options.DB,
            )
            owed.append(ReplaceNodeRequest(node_id=r.node_id, reason=reason, immediate=True, recheck_s=recheck_s))
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
            found = await workflow.execute_activity(
                "reserve_replacement",
                ReplacementInput(allocation_id=self._allocation_id, exclude=self._provision_failed_nodes),
                result_type=ReplacementResult,
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
            if workflow.patched(FABRIC_PATCH) and not await self._join_fabric(
                found.node_id, view, note=found.node_id not in fabric_noted
            ):
                fabric_noted.add(found.node_id)
                await self._pause(req.recheck_s)
                continue
            if self._provision_tries_left is not None:
                self._provision_tries_left -= 1
            provisioning = await self._start_node_op(found.node_id, NodeOperationKind.PROVISION, view)
            if workflow.patched(PULL_WHILE_REPLACING_PATCH):
                provisioned = await self._pulling_while(provisioning, found.node_id, view, owed)
            else:
                provisioned = await provisioning
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
            await workflow.execute_activity(
                "attach_node",
                AttachNodeInput(
                    allocation_id=self._allocation_id,
                    node_id=found.node_id,
                    replaces=req.node_id,
                    ready=len(owed) == 1 and not self._replacements,
                ),
                result_type=AllocationView,
                **options.DB,
            )
            self._ledger.node_added(view, found.node_id)
            owed.pop(0)
        return pulled_any

    async def _pulling_while(
        self, provisioning: asyncio.Task, node_id: str, view: AllocationView, owed: list[ReplaceNodeRequest]
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
        try:
            await workflow.wait_condition(
                lambda: self._cancel_requested, timeout=timedelta(seconds=max(r.grace_s for r in graceful))
            )
        except TimeoutError:
            pass
        if self._cancel_requested:
            return pulled  # the release takes the rest with the allocation
        return pulled + await self._detach_and_drain(graceful, view)

    async def _detach_and_drain(self, reqs: list[ReplaceNodeRequest], view: AllocationView) -> list[ReplaceNodeRequest]:
        if not reqs:
            return []
        members = (await self._load()).node_ids
        pulled = [r for r in reqs if r.node_id in members]
        for r in pulled:
            await workflow.execute_activity(
                "detach_node",
                DetachNodeInput(allocation_id=self._allocation_id, node_id=r.node_id, reason=r.reason),
                result_type=AllocationView,
                **options.DB,
            )
            self._replaced_any = True
            self._ledger.node_removed(view, r.node_id)
        await self._remove_fabric([r.node_id for r in pulled])
        drains = [await self._start_node_op(r.node_id, NodeOperationKind.DRAIN, view) for r in pulled]
        if workflow.patched(DRAIN_BEHIND_PATCH):
            # The node is already out of the allocation and its fabric: its replacement, and the
            # next pull, need not wait for the drain (the agent stopping what ran there).
            self._draining = [d for d in self._draining if not d.done()] + drains
        else:
            await asyncio.gather(*drains)
        return pulled

    async def _drains_finished(self) -> None:
        """Every drain started is done (a run that ends would take its child drains with it)."""
        if self._draining:
            await asyncio.gather(*self._draining)
            self._draining = []

    async def _replace(self, req: ReplaceNodeRequest, view: AllocationView) -> None:
        """One node at a time: what workflows started before "replace-in-bursts" replay."""
        self._phase = "replacing"
        if not req.immediate and req.grace_s > 0:
            await self._note(
                "fault_notice",
                f"{req.reason}; node {req.node_id} will be pulled in {req.grace_s:g} s: checkpoint now",
                req.node_id,
            )
            try:
                await workflow.wait_condition(lambda: self._cancel_requested, timeout=timedelta(seconds=req.grace_s))
            except TimeoutError:
                pass
            if self._cancel_requested:
                return  # the release takes the node with the rest
        before = await workflow.execute_activity(
            "load_allocation",
            AllocationInput(allocation_id=self._allocation_id),
            result_type=AllocationView,
            **options.DB,
        )
        if req.node_id not in before.node_ids:
            return  # already pulled (a repeated signal)
        await workflow.execute_activity(
            "detach_node",
            DetachNodeInput(allocation_id=self._allocation_id, node_id=req.node_id, reason=req.reason),
            result_type=AllocationView,
            **options.DB,
        )
        self._replaced_any = True
        drain = await self._start_node_op(req.node_id, NodeOperationKind.DRAIN, view)
        await drain
        waiting_noted = False
        while not self._cancel_requested:
            found = await workflow.execute_activity(
                "reserve_replacement",
                ReplacementInput(allocation_id=self._allocation_id),
                result_type=ReplacementResult,
                **options.DB,
            )
            if found.node_id is None:
                if not waiting_noted:
                    await self._set_status(view, "degraded", f"node {req.node_id} pulled: {req.reason}; {found.reason}")
                    await self._note("waiting_for_capacity", found.reason, req.node_id)
                    waiting_noted = True
                try:
                    await workflow.wait_condition(
                        lambda: self._cancel_requested, timeout=timedelta(seconds=req.recheck_s)
                    )
                except TimeoutError:
                    pass
                continue
            await self._note(
                "replacement_started", f"provisioning {found.node_id} to replace {req.node_id}", found.node_id
            )
            provisioned = await (await self._start_node_op(found.node_id, NodeOperationKind.PROVISION, view))
            if not provisioned.ok:
                continue  # that node goes back through wipe and burn-in; try another
            # Attached even when a cancel came meanwhile, so that the release takes it too.
            await workflow.execute_activity(
                "attach_node",
                AttachNodeInput(
                    allocation_id=self._allocation_id,
                    node_id=found.node_id,
                    replaces=req.node_id,
                    ready=len(self._replacements) <= 1,
                ),
                result_type=AllocationView,
                **options.DB,
            )
            return

    async def _apply_fabric(self, *, joining: list[str] | None = None) -> str | None:
        """Apply the allocation's fabric membership (its nodes, and `joining`) and read it back;
        None once it holds, else why it could not be applied."""
        try:
            await workflow.execute_activity(
                "apply_allocation_fabric",
                FabricApplyInput(allocation_id=self._allocation_id, joining=joining or []),
                result_type=FabricMembershipResult,
                **options.FABRIC_APPLY,
            )
        except ActivityError as err:
            # The details may name other allocations' partitions: they go to the operator's log
            # (and the history), the tenant sees what kind of failure it was.
            workflow.logger.warning("fabric membership of %s not applied: %s", self._allocation_id, _failure_chain(err))
            return f"fabric isolation could not be applied and verified ({_failure_kind(err)}); nothing was kept"
        return None

    async def _remove_fabric(self, node_ids: list[str]) -> None:
        if node_ids and workflow.patched(FABRIC_PATCH):
            await workflow.execute_activity(
                "remove_allocation_fabric_nodes",
                FabricRemoveInput(allocation_id=self._allocation_id, node_ids=node_ids),
                result_type=FabricMembershipResult,
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
        try:
            await workflow.wait_condition(
                lambda: self._cancel_requested or bool(self._replacements), timeout=timedelta(seconds=seconds)
            )
        except TimeoutError:
            pass

    async def _note(self, kind: str, reason: str, node_id: str | None = None) -> None:
        await workflow.execute_activity(
            "record_allocation_event",
            AllocationEventInput(allocation_id=self._allocation_id, kind=kind, reason=reason, node_id=node_id),
            **options.DB,
        )

    async def _release(self, view: AllocationView) -> None:
        """Release every node (the agents confirm the tenant is off), then start their recycling."""
        self._phase = "releasing"
        self._nodes_done = 0
        self._ledger.releasing()
        if workflow.patched(FABRIC_PATCH):
            # Off the fabrics first: no path to the tenant is left once its nodes are recycled.
            await workflow.execute_activity(
                "release_allocation_fabric",
                FabricReleaseInput(allocation_id=self._allocation_id),
                result_type=FabricMembershipResult,
                **options.FABRIC_REMOVE,
            )
        await self._recycle_wiping(await self._run_on_nodes(view, NodeOperationKind.RELEASE), view)

    async def _recycle_wiping(self, results: list[NodeOperationResult], view: AllocationView) -> None:
        for result in results:
            if result.state == "wiping":
                # Wipe and burn-in take long and are the node's business, not the tenant's:
                # they continue after this workflow ends.
                await self._start_node_op(
                    result.node_id, NodeOperationKind.RECYCLE, view, parent_close_policy=ParentClosePolicy.ABANDON
                )

    async def _finish(self, view: AllocationView, status: str, reason: str | None) -> AllocationResult:
        await self._drains_finished()
        self._phase = status
        await self._set_status(view, status, reason)
        self._ledger.ended(view)
        await self._ledger.flushed()
        return AllocationResult(allocation_id=view.allocation_id, status=status, failure_reason=reason)

    async def _run_on_nodes(self, view: AllocationView, op: NodeOperationKind) -> list[NodeOperationResult]:
        async def one(node_id: str) -> NodeOperationResult:
            handle = await self._start_node_op(node_id, op, view)
            result = await handle
            self._nodes_done += 1
            return result

        return list(await asyncio.gather(*(one(n) for n in view.node_ids)))

    async def _start_node_op(
        self,
        node_id: str,
        op: NodeOperationKind,
        view: AllocationView,
        *,
        parent_close_policy: ParentClosePolicy = ParentClosePolicy.TERMINATE,
    ):
        # The node's previous workflow (say, bring-up) may still be closing: wait for it, since
        # one node runs one operation at a time.
        while True:
            try:
                return await workflow.start_child_workflow(
                    NodeOperationWorkflow.run,
                    NodeOperationInput(
                        node_id=node_id, operation=op, allocation_id=view.allocation_id, tenant_id=view.tenant_id
                    ),
                    id=workflow_id_for(node_id),
                    parent_close_policy=parent_close_policy,
                    search_attributes=sa.typed(
                        (sa.NODE_ID, node_id), (sa.ALLOCATION_ID, view.allocation_id), (sa.TENANT_ID, view.tenant_id)
                    ),
                )
            except WorkflowAlreadyStartedError:
                await workflow.sleep(CHILD_START_RETRY)

    async def _load(self) -> AllocationView:
        return await workflow.execute_activity(
            "load_allocation",
            AllocationInput(allocation_id=self._allocation_id),
            result_type=AllocationView,
            **options.DB,
        )

    async def _set_status(self, view: AllocationView, status: str, reason: str | None = None) -> None:
        await workflow.execute_activity(
            "set_allocation_status",
            AllocationStatusInput(allocation_id=view.allocation_id, status=status, failure_reason=reason),
            result_type=AllocationView,
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
