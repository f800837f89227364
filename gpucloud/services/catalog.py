"""What the fleet offers: the GPU types and regions it has nodes of, and how many are free now.

The catalogue (`models/catalog.py`) lists every GPU type the cloud knows how to run; the fleet
offers only those it has nodes of. A node counts while it belongs to the fleet (anything but
`retired` or `rma`: a node in repair or burn-in comes back), and is available now when a
reservation could take it this moment (`allocatable`, what placement takes too). A request for a
type or region the fleet has none of is refused up front (`NotOffered`), naming what it does
offer: waiting would not help, unlike a shortage of a type it has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Session, col, select

from gpucloud.models.catalog import GPU_TYPES
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import Node, utcnow
from gpucloud.services.errors import Invalid

# Nodes that have left the fleet: a retired node never returns, an RMA'd one only as a new
# enrolment once its hardware is replaced.
OUT_OF_FLEET = (NodeState.RETIRED.value, NodeState.RMA.value)


def allocatable(now: datetime | None = None) -> tuple[sa.ColumnElement[bool], ...]:
    """The conditions under which a reservation may take a node now: available, healthy, neither
    cordoned nor in maintenance, and no scheduled diagnostic holds it (`services/diagnostics.py`:
    its lease has not lapsed)."""
    return (
        col(Node.state) == NodeState.AVAILABLE,
        col(Node.cordoned) == False,
        col(Node.maintenance) == False,
        col(Node.health) == "ok",
        not_diagnosing(now or utcnow()),
    )


def not_diagnosing(now: datetime) -> sa.ColumnElement[bool]:
    """No scheduled diagnostic holds the node: never leased, released, or its lease lapsed."""
    return sa.or_(col(Node.diag_lease_until).is_(None), col(Node.diag_lease_until) <= now)


@dataclass(frozen=True)
class Offer:
    gpu_type: str
    region: str
    nodes: int  # in the fleet
    available_nodes: int  # a reservation could take now

    @property
    def gpus_per_node(self) -> int:
        return GPU_TYPES.get(self.gpu_type, 0)


def fleet_offers(session: Session, *, gpu_type: str | None = None, region: str | None = None) -> list[Offer]:
    """Every (GPU type, region) the fleet has nodes of, with how many are available now."""
    available = sa.case((sa.and_(*allocatable()), 1), else_=0)
    query = (
        select(col(Node.gpu_type), col(Node.region), sa.func.count(), sa.func.coalesce(sa.func.sum(available), 0))
        .where(col(Node.state).not_in(OUT_OF_FLEET))
        .group_by(col(Node.gpu_type), col(Node.region))
        .order_by(col(Node.gpu_type), col(Node.region))
    )
    if gpu_type is not None:
        query = query.where(col(Node.gpu_type) == gpu_type)
    if region is not None:
        query = query.where(col(Node.region) == region)
    return [Offer(t, r, int(n), int(a)) for t, r, n, a in session.exec(query).all()]


class NotOffered(Exception):
    """The fleet has no node of the type in the region: `field` names which part of the request."""

    def __init__(self, field: str, message: str, *, offered: Sequence[Offer]) -> None:
        super().__init__(message)
        self.field, self.message = field, message
        self.offered = [{"gpu_type": o.gpu_type, "region": o.region} for o in offered]


def refusal(exc: NotOffered) -> Invalid:
    """The 422 for a type or region the fleet has none of, naming the field."""
    title = "Unknown region" if exc.field == "region" else "GPU type not offered"
    return Invalid(exc.field, exc.message, "not-offered", title=title)


def _listing(offers: Sequence[Offer]) -> str:
    regions: dict[str, list[str]] = {}
    for offer in offers:
        regions.setdefault(offer.gpu_type, []).append(offer.region)
    listed = (f"{t} in {', '.join(sorted(rs))}" for t, rs in sorted(regions.items()))
    return "; ".join(listed) or "nothing (no node enrolled)"


def check_offered(offers: Sequence[Offer], *, gpu_type: str, region: str) -> None:
    """Raise `NotOffered` unless `offers` (the whole fleet's) hold the type in the region."""
    if any(o.gpu_type == gpu_type and o.region == region for o in offers):
        return
    if not any(o.region == region for o in offers):
        regions = ", ".join(sorted({o.region for o in offers})) or "none"
        raise NotOffered("region", f"unknown region {region!r}; regions on offer: {regions}", offered=offers)
    elsewhere = sorted(o.region for o in offers if o.gpu_type == gpu_type)
    if elsewhere:
        message = f"the fleet has no {gpu_type} nodes in {region}; {gpu_type} is on offer in {', '.join(elsewhere)}"
    else:
        message = f"the fleet has no {gpu_type} nodes; on offer: {_listing(offers)} (`gpucloud catalog`)"
    raise NotOffered("gpu_type", message, offered=offers)


def require_offered(session: Session, *, gpu_type: str, region: str) -> None:
    """`check_offered` against the fleet: one indexed lookup when the pool exists, the whole
    listing only to word a refusal."""
    present = select(col(Node.id)).where(
        col(Node.gpu_type) == gpu_type, col(Node.region) == region, col(Node.state).not_in(OUT_OF_FLEET)
    )
    if session.exec(present.limit(1)).first() is None:
        check_offered(fleet_offers(session), gpu_type=gpu_type, region=region)
