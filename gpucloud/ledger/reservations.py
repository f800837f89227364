"""Capacity reservations: a tenant buys ``node_count`` nodes of a GPU type for a window.

The control plane records each one by id (``POST /v1/reservations``); the same id with the same
content again is acknowledged, with other content it is a conflict. A reservation is billed for
its whole window ``[start_ms, end_ms)`` x ``node_count`` x the catalog's GPUs per node of its
GPU type (stored with it, so a later catalog cannot change its bill) at the reserved price of
the version in force, used or not; the window is split by usage period and price version like
held time (``held.py``). Allocations the control plane marks ``reserved`` run inside a
reservation, and their held time is not billed again.

At each close, every reservation's part in the usage periods up to the one closing is posted
(``source: reserved``, the reservation's id in the posting's ``allocation_id``), less what was
posted for it before: a reservation recorded after its period closed is billed on the next
invoice, like late usage.
"""

from __future__ import annotations

from collections import defaultdict

from sqlalchemy import Connection, func, insert, select

from gpucloud.ledger import problems
from gpucloud.ledger.close import LineAggregate
from gpucloud.ledger.held import split_by_period_and_version
from gpucloud.ledger.periods import period_bounds
from gpucloud.ledger.pricing import RESERVED, PriceBookHistory
from gpucloud.ledger.schemas import ReservationIn, ReservationOut
from gpucloud.ledger.tables import postings, reservations

_CONTENT = ("tenant_id", "gpu_type", "node_count", "start_ms", "end_ms")


def catalog_gpu(gpu_type: str) -> tuple[str, int] | None:
    """A GPU type as the catalog spells it (matched case-insensitively) and its GPUs per node."""
    from gpucloud.models.catalog import GPU_TYPES, known_gpu_type

    name = known_gpu_type(gpu_type)
    return None if name is None else (name, GPU_TYPES[name])


def record_reservation(connection: Connection, reservation: ReservationIn, *, now_ms: int) -> ReservationOut:
    """Store one reservation; call inside the ledger's write transaction. Its GPU type is stored
    as the catalog spells it, as the price book names it (an `h100` reservation is billed at
    H100's reserved price, and is the same content as one sent as `H100`)."""
    known = catalog_gpu(reservation.gpu_type)
    if known is None:
        raise problems.LedgerProblem(
            problems.REQUEST_INVALID(f"the catalog sells no GPU type {reservation.gpu_type!r}", field="gpu_type")
        )
    gpu_type, per_node = known
    reservation = reservation.model_copy(update={"gpu_type": gpu_type})
    existing = (
        connection.execute(select(reservations).where(reservations.c.reservation_id == reservation.reservation_id))
        .mappings()
        .first()
    )
    if existing is not None:
        if any(existing[name] != getattr(reservation, name) for name in _CONTENT):
            raise problems.LedgerProblem(
                problems.STATE_CONFLICT(
                    f"reservation {reservation.reservation_id} was recorded with different content",
                    field="reservation_id",
                )
            )
        return ReservationOut(**existing, replayed=True)
    if reservation.end_ms <= reservation.start_ms:
        raise problems.LedgerProblem(problems.REQUEST_INVALID("end_ms must be after start_ms", field="end_ms"))
    row = {**reservation.model_dump(), "gpus_per_node": per_node, "recorded_ms": now_ms}
    row_id = connection.execute(insert(reservations).returning(reservations.c.id), row).scalar_one()
    return ReservationOut(**row, id=row_id)


def list_reservations(connection: Connection, *, tenant_id: str) -> list[ReservationOut]:
    rows = connection.execute(
        select(reservations)
        .where(reservations.c.tenant_id == tenant_id)
        .order_by(reservations.c.start_ms, reservations.c.id)
    ).mappings()
    return [ReservationOut(**row) for row in rows]


def reservation_true_up(
    connection: Connection, period_id: str, *, history: PriceBookHistory, tenant_id: str | None = None
) -> list[LineAggregate]:
    """What to post so that every reservation's window in the usage periods up to ``period_id``
    is billed at the reserved price: one line per (reservation, usage period, price version)."""
    _, period_end = period_bounds(period_id)
    query = select(reservations).where(reservations.c.start_ms < period_end)
    if tenant_id is not None:
        query = query.where(reservations.c.tenant_id == tenant_id)
    rows = connection.execute(query).mappings().all()
    if not rows:
        return []
    due: dict[tuple[str, str, str, str, int], int] = defaultdict(int)
    for row in rows:
        gpus = row["node_count"] * row["gpus_per_node"]
        for start, end, usage_period, version_id in split_by_period_and_version(
            row["start_ms"], min(row["end_ms"], period_end), history
        ):
            due[(row["tenant_id"], row["reservation_id"], row["gpu_type"], usage_period, version_id)] += (
                end - start
            ) * gpus
    posted = _posted(connection, sorted({row["reservation_id"] for row in rows}))
    result = []
    for key in sorted(set(due) | set(posted)):
        tenant, reservation_id, gpu_type, usage_period, version_id = key
        rate = history.by_id(version_id).rate_for(tenant, gpu_type, RESERVED)
        if rate is None:
            continue
        gpu_ms = due.get(key, 0)
        posted_ms, posted_amount = posted.get(key, (0, 0))
        delta_ms, delta_amount = gpu_ms - posted_ms, rate.amount_for(gpu_ms) - posted_amount
        if delta_ms or delta_amount:
            result.append(
                LineAggregate(
                    tenant,
                    reservation_id,
                    gpu_type,
                    usage_period,
                    version_id,
                    1,
                    delta_ms,
                    delta_amount,
                    "reserved",
                    RESERVED,
                )
            )
    return result


def _posted(
    connection: Connection, reservation_ids: list[str]
) -> dict[tuple[str, str, str, str, int], tuple[int, int]]:
    columns = (
        postings.c.tenant_id,
        postings.c.allocation_id,
        postings.c.gpu_type,
        postings.c.usage_period,
        postings.c.price_version_id,
    )
    rows = connection.execute(
        select(*columns, func.sum(postings.c.gpu_ms), func.sum(postings.c.amount_micro))
        .where(
            postings.c.allocation_id.in_(reservation_ids), postings.c.kind == "usage", postings.c.source == "reserved"
        )
        .group_by(*columns)
    )
    return {tuple(row[:5]): (int(row[5]), int(row[6])) for row in rows}
