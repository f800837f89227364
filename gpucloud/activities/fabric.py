"""Activities over the fabric managers (UFM, NMX-M, SDN): an allocation's membership applied and
read back, nodes taken out of it, and its release.

Each activity reads what it needs from the control-plane database (the allocation's tenant and
nodes, each node's port GUIDs, NVL72 domain and GPU UIDs) and then converges the managers with
`gpucloud.fabric.membership`, whose steps are idempotent: a retried activity, or one run again
after a crash, finds what the last try did by name and finishes it.

Errors are classified here. A refusal (a manager's 4xx naming the constraint it would break) is
final for an apply (non-retryable `FabricRefused`: the allocation fails closed); a read-back that
differs from what was applied (`FabricMismatch`), an unreachable manager and a 5xx are transient
and retried. Removal and release retry everything, for as long as it takes: membership left
behind is a path into the next tenant's allocation.

Without configured managers (`FabricSettings.manager_urls` is None, the embedded default) every
activity returns `applied=False` and touches nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlmodel import col, select
from temporalio import activity
from temporalio.exceptions import ApplicationError

from gpucloud.activities import ActivityGroup
from gpucloud.db import Database
from gpucloud.fabric import membership
from gpucloud.fabric.http_clients import HttpFabricController
from gpucloud.fabric.interface import FabricError, FabricNode, FabricVerificationError
from gpucloud.models.fabric_messages import (
    FabricApplyInput,
    FabricMembershipResult,
    FabricReleaseInput,
    FabricRemoveInput,
)
from gpucloud.models.tables import Allocation, Node

ControllerFactory = Callable[[], HttpFabricController]


def fabric_node(node: Node) -> FabricNode:
    """What the fabric managers know a node by: its ports, its NVLink domain and GPUs."""
    return FabricNode(
        node_id=node.id,
        port_guids=tuple(node.ib_port_guids),
        nvl_domain=node.nvlink_domain,
        gpu_uids=tuple(node.gpu_uids),
    )


class FabricActivities(ActivityGroup):
    def __init__(self, db: Database, controller: ControllerFactory | None) -> None:
        """`controller` makes a controller per call (None: no managers configured): activities run
        on many threads at once, and each gets its own connection pool."""
        self.db = db
        self._controller = controller

    @activity.defn
    def apply_allocation_fabric(self, req: FabricApplyInput) -> FabricMembershipResult:
        """The allocation's members (and `joining`) on its pkey, NVLink partitions and the tenant's
        VPC, read back: exactly those nodes, or an error."""
        if self._controller is None:
            return FabricMembershipResult(allocation_id=req.allocation_id, applied=False)
        tenant_id, node_ids = self._members(req.allocation_id)
        nodes = self._fabric_nodes([*node_ids, *(n for n in req.joining if n not in node_ids)])
        with self._managers() as controller:
            try:
                applied = membership.apply_and_verify(controller, req.allocation_id, tenant_id, nodes)
            except FabricError as exc:
                raise ApplicationError(
                    f"a fabric manager refused: {exc}", type="FabricRefused", non_retryable=True
                ) from exc
        return FabricMembershipResult(
            allocation_id=req.allocation_id,
            applied=True,
            node_ids=[n.node_id for n in nodes],
            pkey=applied.pkey,
            nvl_partition_ids=list(applied.nvl_partition_ids),
            vni=applied.vni,
        )

    @activity.defn
    def remove_allocation_fabric_nodes(self, req: FabricRemoveInput) -> FabricMembershipResult:
        """Nodes leaving the allocation (pulled, or a replacement given up) lose its membership."""
        if self._controller is None:
            return FabricMembershipResult(allocation_id=req.allocation_id, applied=False)
        tenant_id, _ = self._members(req.allocation_id)
        nodes = self._fabric_nodes(req.node_ids)
        with self._managers() as controller:
            membership.remove_nodes(controller, req.allocation_id, tenant_id, nodes)
        return FabricMembershipResult(allocation_id=req.allocation_id, applied=True, node_ids=req.node_ids)

    @activity.defn
    def release_allocation_fabric(self, req: FabricReleaseInput) -> FabricMembershipResult:
        """The allocation's pkey and NVLink partitions go; its nodes leave the tenant's VPC."""
        if self._controller is None:
            return FabricMembershipResult(allocation_id=req.allocation_id, applied=False)
        tenant_id, node_ids = self._members(req.allocation_id, with_reserved=True)
        nodes = self._fabric_nodes(node_ids)
        with self._managers() as controller:
            membership.release(controller, req.allocation_id, tenant_id, nodes)
        return FabricMembershipResult(allocation_id=req.allocation_id, applied=True, node_ids=node_ids)

    @contextmanager
    def _managers(self) -> Iterator[HttpFabricController]:
        assert self._controller is not None  # callers check that managers are configured
        with self._controller() as controller:
            try:
                yield controller
            except FabricVerificationError as exc:
                raise ApplicationError(f"fabric read-back differs: {exc}", type="FabricMismatch") from exc
            except FabricError as exc:
                # Outside an apply a refusal is a race (say, a partition another try just
                # deleted): the next try reads afresh.
                raise ApplicationError(f"a fabric manager refused: {exc}", type="FabricConflict") from exc

    def _members(self, allocation_id: str, *, with_reserved: bool = False) -> tuple[str, list[str]]:
        """The allocation's tenant and nodes; `with_reserved` adds nodes held for it but not
        attached (a replacement on its way), which a release must clear too."""
        with self.db.session() as session:
            alloc = session.exec(select(Allocation).where(col(Allocation.id) == allocation_id)).first()
            if alloc is None:
                raise ApplicationError(
                    f"allocation {allocation_id} does not exist", type="AllocationNotFound", non_retryable=True
                )
            node_ids = list(alloc.node_ids)
            if with_reserved:
                held = session.exec(select(col(Node.id)).where(col(Node.allocation_id) == allocation_id)).all()
                node_ids += sorted(set(held) - set(node_ids))
            return alloc.tenant_id, node_ids

    def _fabric_nodes(self, node_ids: list[str]) -> list[FabricNode]:
        with self.db.session() as session:
            found = {n.id: n for n in session.exec(select(Node).where(col(Node.id).in_(node_ids))).all()}
        if missing := [n for n in node_ids if n not in found]:
            raise ApplicationError(f"nodes {missing} do not exist", type="NodeNotFound", non_retryable=True)
        return [fabric_node(found[i]) for i in node_ids]
