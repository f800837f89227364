"""Issue 43: capacity reservations in the database (SQLite, and Postgres when reachable).

A tenant books N nodes of a pool for a future window; it is accepted only if the pool can honour
it beside the reservations already accepted (one fabric domain each, at every moment), and within
the tenant's quota. The pool's plan holds the nodes ahead of the window (a create cannot take
them), takes them back from preemptible work, places the reservation's allocation ahead of its
start, and ends it at the window's end."""

from __future__ import annotations

from datetime import timedelta

import httpx
import pytest
import sqlalchemy as sa
from sqlmodel import col, select

from gpucloud.config import SchedulerSettings
from gpucloud.db import Database, session_scope
from gpucloud.models.api_schemas import AllocationRequest
from gpucloud.models.health_tables import AllocationEvent
from gpucloud.models.scheduling_tables import CapacityReservation
from gpucloud.models.tables import (
    Allocation,
    AllocationStatus,
    Node,
    utcnow,
)
from gpucloud.services import reservations, scheduling
from gpucloud.services.allocation_requests import reserve_and_record
from gpucloud.services.errors import Conflict, DomainError, Invalid, QuotaExceeded
from support.pools import seed_pool

pytestmark = pytest.mark.integration

SETTINGS = SchedulerSettings(
    reservation_min_notice_s=60, reservation_hold_s=600, reservation_prepare_s=60, preemption_notice_s=30
)


def _fleet(db_url: str, *, pods: int = 2, per_pod: int = 4) -> None:
    seed_pool(db_url, pods=pods, per_pod=per_pod, tenants=2, max_gpus=64)


def _book(db_url: str, tenant: str, nodes: int, start_in_s: float, hours: float = 1.0, **kw) -> CapacityReservation:
    now = kw.pop("now", utcnow())
    start = now + timedelta(seconds=start_in_s)
    ask = reservations.ReservationAsk("H100", "r1", nodes, start, start + timedelta(hours=hours))
    with session_scope(db_url) as session:
        row = reservations.create(session, tenant, ask, settings=SETTINGS, now=now, **kw)
        session.flush()
        session.expunge(row)
        return row


def _row(db_url: str, model, ident: str):
    with session_scope(db_url) as session:
        row = session.exec(select(model).where(col(model.id) == ident)).one()
        session.expunge(row)
        return row


def _plan(db: Database, now) -> scheduling.PoolPlan:
    return scheduling.plan_pool(db, "H100", "r1", settings=SETTINGS, deadline_scale=1.0, now=now)


def test_a_reservation_is_accepted_only_where_the_pool_can_honour_it(db_url):
    _fleet(db_url, pods=2, per_pod=4)
    first = _book(db_url, "ten_0", 4, 3600)
    assert first.status == "accepted"
    _book(db_url, "ten_1", 3, 3600 + 1800)  # the other pod, overlapping by half
    with pytest.raises(Conflict) as refused:  # neither pod has 2 left during the overlap
        _book(db_url, "ten_1", 2, 3600 + 1800)
    assert refused.value.type_ == "reservation-infeasible"
    _book(db_url, "ten_1", 1, 3600 + 1800)  # one node still fits beside the three
    _book(db_url, "ten_1", 4, 3 * 3600)  # after the others end, the whole pod again
    with pytest.raises(Conflict):
        _book(db_url, "ten_0", 5, 5 * 3600)  # no pod has 5 nodes


def test_bad_windows_and_quotas_are_refused_naming_what_is_wrong(db_url):
    _fleet(db_url)
    with pytest.raises(Invalid) as soon:
        _book(db_url, "ten_0", 1, 10)  # less than the minimum notice
    assert soon.value.members.get("field", soon.value.detail) and "start_at" in str(vars(soon.value))
    with pytest.raises(Invalid) as backwards:
        _book(db_url, "ten_0", 1, 3600, hours=-1)
    assert "end_at" in str(vars(backwards.value))
    with pytest.raises(QuotaExceeded):
        _book(db_url, "ten_0", 9, 3600)  # 72 GPUs against a quota of 64
    with pytest.raises(DomainError):
        reservations.create(
            Database(db_url).session().__enter__(),
            "ten_0",
            reservations.ReservationAsk(
                "H100", "nowhere", 1, utcnow() + timedelta(hours=1), utcnow() + timedelta(hours=2)
            ),
            settings=SETTINGS,
        )


def test_a_cancel_loses_to_a_plan_that_began_the_window_meanwhile(db_url, monkeypatch):
    """The cancel read its reservation `accepted`; a plan moved it to `active` (its allocation
    placed) before the cancel wrote: the cancel is refused, and the window runs and is billed."""
    if db_url.startswith("sqlite"):
        pytest.skip("SQLite's transactions take the write lock at BEGIN: no plan can write in between")
    _fleet(db_url, pods=1, per_pod=4)
    booked = _book(db_url, "ten_0", 2, 3600)
    read = reservations.get

    def read_then_begun(session, reservation_id, **kw):
        row = read(session, reservation_id, **kw)
        with session_scope(db_url) as other:  # the plan, in a transaction of its own
            other.execute(
                sa.update(CapacityReservation)
                .where(col(CapacityReservation.id) == reservation_id)
                .values(status="active", allocation_id="alloc_placed")
            )
        return row

    monkeypatch.setattr(reservations, "get", read_then_begun)
    with session_scope(db_url) as session, pytest.raises(Conflict) as refused:
        reservations.cancel(session, booked.id, tenant_id="ten_0", actor="tenant:ten_0")
    assert "is active" in refused.value.detail and "alloc_placed" in refused.value.detail
    assert _row(db_url, CapacityReservation, booked.id).status == "active"


def test_a_create_again_under_its_key_is_the_same_reservation_and_cancel_frees_the_window(db_url):
    _fleet(db_url, pods=1, per_pod=4)
    first = _book(db_url, "ten_0", 4, 3600, idempotency_tag="ten_0:k1")
    again = _book(db_url, "ten_0", 4, 3600, idempotency_tag="ten_0:k1")
    assert again.id == first.id
    with pytest.raises(Conflict):
        _book(db_url, "ten_1", 1, 3600)
    with session_scope(db_url) as session:
        assert reservations.cancel(session, first.id, tenant_id="ten_0", actor="tenant:ten_0").status == "cancelled"
    _book(db_url, "ten_1", 1, 3600)  # the window is free again
    with session_scope(db_url) as session, pytest.raises(DomainError):
        reservations.get(session, first.id, tenant_id="ten_1")  # another tenant's: not found


def test_the_plan_holds_the_nodes_takes_them_back_and_runs_the_window(db_url):
    _fleet(db_url, pods=1, per_pod=4)
    db = Database(db_url)
    spare_req = AllocationRequest(gpu_type="H100", region="r1", node_count=2, tier="preemptible")
    spare, _ = reserve_and_record(db, "ten_1", spare_req, actor="t", deadline_scale=1.0, scheduler=SETTINGS)
    with session_scope(db_url) as session:
        row = session.exec(select(Allocation).where(col(Allocation.id) == spare.id)).one()
        row.status = AllocationStatus.READY
        session.add(row)
    now = utcnow()
    booked = _book(db_url, "ten_0", 4, 300, now=now)  # starts in 5 minutes: its nodes are held
    start = booked.start_at

    # Inside the hold, a create with no known end cannot take the two free nodes.
    with pytest.raises(DomainError):
        reserve_and_record(
            db,
            "ten_1",
            AllocationRequest(gpu_type="H100", region="r1", node_count=1),
            actor="t",
            deadline_scale=1.0,
            scheduler=SETTINGS,
        )

    # Before the start, less the preparation and the notice, the preemptible work is taken back.
    plan = _plan(db, start - timedelta(seconds=60 + 30 + 10))
    assert [n.allocation_id for n in plan.notices] == [spare.id] and plan.start == []
    assert _row(db_url, Allocation, spare.id).preempted_for == booked.id
    # Its nodes come back (released, wiped); at the start less the preparation, the window is placed.
    with session_scope(db_url) as session:
        alloc = session.exec(select(Allocation).where(col(Allocation.id) == spare.id)).one()
        alloc.status = AllocationStatus.RELEASED
        session.add(alloc)
        for node in session.exec(select(Node)).all():
            node.state, node.allocation_id = "available", None
            session.add(node)
    plan = _plan(db, start - timedelta(seconds=50))
    ((allocation_id, tenant),) = plan.start
    window = _row(db_url, Allocation, allocation_id)
    assert tenant == "ten_0" and window.tier == "reserved" and window.reservation_id == booked.id
    assert len(window.node_ids) == 4 and window.status == "provisioning"
    assert _row(db_url, CapacityReservation, booked.id).status == "active"
    # Ready before its start: recorded as on time.
    with session_scope(db_url) as session:
        alloc = session.exec(select(Allocation).where(col(Allocation.id) == allocation_id)).one()
        alloc.status = AllocationStatus.READY
        session.add(alloc)
    _plan(db, start - timedelta(seconds=5))
    assert _row(db_url, CapacityReservation, booked.id).ready_at is not None
    # At its end, its allocation is cancelled (the workflow releases it), then the reservation ends.
    plan = _plan(db, booked.end_at + timedelta(seconds=1))
    assert plan.cancel == [allocation_id]
    ended = _row(db_url, Allocation, allocation_id)
    assert ended.desired == "cancelled"
    with session_scope(db_url) as session:
        kinds = [
            e.kind
            for e in session.exec(select(AllocationEvent).where(col(AllocationEvent.allocation_id) == allocation_id))
        ]
        alloc = session.exec(select(Allocation).where(col(Allocation.id) == allocation_id)).one()
        alloc.status = AllocationStatus.RELEASED
        session.add(alloc)
    assert "reservation_ended" in kinds and "cancel_requested" in kinds
    _plan(db, booked.end_at + timedelta(seconds=2))
    assert _row(db_url, CapacityReservation, booked.id).status == "ended"


def _set_status(db_url: str, allocation_id: str, status: AllocationStatus, *, free_nodes: bool = False) -> None:
    with session_scope(db_url) as session:
        alloc = session.exec(select(Allocation).where(col(Allocation.id) == allocation_id)).one()
        alloc.status = status
        session.add(alloc)
        if free_nodes:
            for node in session.exec(select(Node)).all():
                node.state, node.allocation_id = "available", None
                session.add(node)


def test_a_window_the_platform_failed_to_provision_is_placed_anew_and_billed_only_once_delivered(db_url):
    _fleet(db_url, pods=1, per_pod=4)
    db = Database(db_url)
    booked = _book(db_url, "ten_0", 2, 300)
    start = booked.start_at
    ((first, _),) = _plan(db, start - timedelta(seconds=50)).start
    # The platform could not provision it (its nodes failed, say): not the tenant's doing.
    _set_status(db_url, first, AllocationStatus.FAILED, free_nodes=True)
    # The next plan takes it up again and places it anew, on the nodes it still holds for it.
    ((second, _),) = _plan(db, start - timedelta(seconds=40)).start
    assert second != first and _row(db_url, Allocation, second).reservation_id == booked.id
    again = _row(db_url, CapacityReservation, booked.id)
    assert again.status == "active" and again.allocation_id == second and again.ready_at is None
    # Its window has begun and nothing was delivered yet: nothing to bill.
    with session_scope(db_url) as session:
        assert reservations.unbilled_count(session, "H100", "r1", now=start + timedelta(seconds=5)) == 0
    # Delivered: from then on it is billed for its window.
    _set_status(db_url, second, AllocationStatus.READY)
    _plan(db, start - timedelta(seconds=5))
    assert _row(db_url, CapacityReservation, booked.id).ready_at is not None
    with session_scope(db_url) as session:
        assert reservations.unbilled_count(session, "H100", "r1", now=start + timedelta(seconds=5)) == 1


def test_a_window_never_delivered_ends_unbilled(db_url):
    _fleet(db_url, pods=1, per_pod=2)
    db = Database(db_url)
    booked = _book(db_url, "ten_0", 2, 300, hours=0.05)  # a three-minute window
    ((first, _),) = _plan(db, booked.start_at - timedelta(seconds=50)).start
    _set_status(db_url, first, AllocationStatus.FAILED)  # its nodes stay out: nothing to place it on
    _plan(db, booked.start_at - timedelta(seconds=40))
    _plan(db, booked.end_at + timedelta(seconds=1))
    ended = _row(db_url, CapacityReservation, booked.id)
    assert ended.status == "ended" and ended.ready_at is None
    with session_scope(db_url) as session:
        assert reservations.unbilled_count(session, "H100", "r1", now=booked.end_at + timedelta(seconds=5)) == 0


async def test_a_reservation_the_ledger_refuses_does_not_hold_back_the_others(db_url, tmp_path):
    """The scheduler's billing step (`LedgerActivities.record_reservations`) against a real ledger
    that refuses the first reservation it is sent (recorded there already with other content):
    the second is still recorded and marked billed, and the refused one is named in the error
    and left to be sent again."""
    from temporalio.exceptions import ApplicationError
    from temporalio.testing import ActivityEnvironment

    from gpucloud.activities.ledger import LedgerActivities
    from gpucloud.ledger.client import LedgerClient
    from gpucloud.models.messages import PoolRef
    from support.ledger_auth import LedgerAuth, issuer_in
    from support.ledger_harness import ledger_in_thread

    _fleet(db_url, pods=2, per_pod=2)
    past = utcnow() - timedelta(hours=2)
    booked = [_book(db_url, f"ten_{i}", 1, 120, now=past) for i in range(2)]
    with session_scope(db_url) as session:
        for row in session.exec(select(CapacityReservation)).all():
            row.ready_at = row.start_at
            session.add(row)
    first, second = sorted(booked, key=lambda r: r.id)
    with (
        ledger_in_thread(f"sqlite:///{tmp_path / 'ledger.db'}", issuer_dir=tmp_path) as url,
        httpx.Client(base_url=url, auth=LedgerAuth(tmp_path), timeout=30) as ledger,
    ):
        window = {"start_ms": 0, "end_ms": 3_600_000, "node_count": 1, "gpu_type": "H100"}
        taken = ledger.post("/v1/reservations", json={"reservation_id": first.id, "tenant_id": "ten_x", **window})
        assert taken.status_code == 201, taken.text
        activities = LedgerActivities(LedgerClient(url, issuer=issuer_in(tmp_path)), Database(db_url))

        with pytest.raises(ApplicationError) as refused:
            await ActivityEnvironment().run(activities.record_reservations, PoolRef(gpu_type="H100", region="r1"))
        assert refused.value.type == "LedgerRefused" and refused.value.non_retryable
        assert first.id in str(refused.value) and "1 of 2" in str(refused.value)

        recorded = {
            r["reservation_id"]
            for t in ("ten_0", "ten_1")
            for r in ledger.get("/v1/reservations", params={"tenant_id": t}).json()
        }
        assert second.id in recorded and first.id not in recorded
    assert _row(db_url, CapacityReservation, second.id).billed_at is not None
    assert _row(db_url, CapacityReservation, first.id).billed_at is None  # sent again at the next plan


def test_a_plan_says_how_long_nothing_can_change_for_reservations_whose_holds_are_ahead(db_url):
    """The pool's scheduler sleeps that long instead of planning every `poll_s` for weeks
    (`workflows/pool_scheduler.py`); once a hold has begun there is no quiet time."""
    _fleet(db_url, pods=1, per_pod=4)
    db = Database(db_url)
    t0 = utcnow()
    _book(db_url, "ten_0", 2, 3600, now=t0)
    _book(db_url, "ten_1", 2, 7200, now=t0)
    ahead = SETTINGS.reservation_hold_s + SETTINGS.reservation_prepare_s
    assert _plan(db, t0).quiet_s == pytest.approx(3600 - ahead, abs=1)
    assert _plan(db, t0 + timedelta(seconds=3600 - ahead + 1)).quiet_s == 0.0  # the first hold began
