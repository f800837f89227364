"""Health rules: XID classes, bursts, tenants, counter trends, signals beyond XIDs, the lemon
rule, the circuit breaker."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpucloud.health.breaker import BreakerState, CircuitBreaker
from gpucloud.health.rules import evaluate_node, fatal_episodes, group_incidents
from gpucloud.health.verdict import Action, Health, HealthPolicy
from gpucloud.health.xid import APPLICATION_XIDS, XID_TABLE, classify_xid
from gpucloud.protocol.reports import (
    EccCounts,
    FatalKind,
    GpuReading,
    NodeReading,
    NvLinkReading,
    ProbeFatal,
    RemappedRows,
    Signal,
    SignalObservation,
    XidEvent,
)

pytestmark = pytest.mark.unit

T0 = datetime(2025, 1, 1, tzinfo=UTC)
DRAINING = {Action.DRAIN, Action.DRAIN_NOW, Action.RMA}


def xid(
    number: int, at: datetime, *, gpu: int = 0, tenant: str | None = "tenant-a", allocation: str | None = None
) -> XidEvent:
    return XidEvent(
        node_id="n1",
        gpu_index=gpu,
        gpu_uuid=f"GPU-{gpu}",
        xid=number,
        timestamp=at,
        tenant_id=tenant,
        allocation_id=allocation,
    )


def gpu(index: int = 0, **fields) -> GpuReading:
    return GpuReading(index=index, uuid=f"GPU-{index}", name="H100", **fields)


def reading(at: datetime, *gpus: GpuReading, fatal: ProbeFatal | None = None) -> NodeReading:
    return NodeReading(node_id="n1", timestamp=at, is_gpu_node=True, gpus=gpus, fatal_error=fatal)


def series(start: datetime, values: list, make, *, step: timedelta = timedelta(minutes=30)) -> list[NodeReading]:
    """One reading per value, `step` apart; `make(value)` builds GPU 0's reading."""
    return [reading(start + i * step, make(value)) for i, value in enumerate(values)]


def judge(events=(), readings=(), *, now: datetime, **kwargs):
    return evaluate_node(events=list(events), readings=list(readings), now=now, **kwargs)


# ------------------------------------------------------------------ the XID table


@pytest.mark.parametrize(
    ("number", "health", "action"),
    [
        *[(n, Health.OK, Action.NONE) for n in (13, 31, 43, 45, 68)],
        *[(n, Health.FAILED, Action.DRAIN) for n in (46, 95, 119, 120, 140, 143)],
        (48, Health.FAILED, Action.DRAIN),
        (63, Health.SUSPECT, Action.WATCH),
        (64, Health.FAILED, Action.DRAIN),
        (74, Health.FAILED, Action.DRAIN),
        (79, Health.FAILED, Action.DRAIN_NOW),
        (92, Health.OK, Action.WATCH),
        (94, Health.SUSPECT, Action.WATCH),
        (999, Health.SUSPECT, Action.WATCH),
    ],
)
def test_each_xid_class_leads_to_its_action(number, health, action):
    verdict = judge([xid(number, T0)], now=T0 + timedelta(minutes=1))

    assert (verdict.health, verdict.action) == (health, action)


def test_the_table_covers_the_architecture_and_only_drains_count_as_fatal():
    assert set(XID_TABLE) == {13, 31, 43, 45, 68, 46, 95, 119, 120, 140, 143, 48, 63, 64, 74, 79, 92, 94}
    assert {n for n, p in XID_TABLE.items() if p.counts_as_fatal} == {46, 95, 119, 120, 140, 143, 48, 64, 74, 79}
    assert {n for n, p in XID_TABLE.items() if p.reset_pending} == {63, 94}
    assert classify_xid(12345).xid == 12345 and not classify_xid(12345).counts_as_fatal


@pytest.mark.parametrize("number", [48, 64])
def test_a_failed_remap_turns_a_memory_xid_into_rma(number):
    failed = gpu(remapped_rows=RemappedRows(correctable=0, uncorrectable=5, pending=False, failure=True))

    verdict = judge([xid(number, T0)], [reading(T0 + timedelta(seconds=30), failed)], now=T0 + timedelta(minutes=1))

    assert verdict.action is Action.RMA and "row_remap_failure" in {c.name for c in verdict.conditions}


def test_watch_level_xids_expire_and_drain_level_ones_wait_for_a_verified_repair():
    events = [xid(94, T0), xid(119, T0)]
    later = T0 + timedelta(days=3)

    verdict = judge(events, now=later)
    assert {c.name for c in verdict.conditions} == {"xid_119"}

    repaired = judge(events, now=later, cleared_at=T0 + timedelta(days=1))
    assert (repaired.health, repaired.action, repaired.conditions) == (Health.OK, Action.NONE, ())


def test_an_xid_after_a_verified_repair_is_a_new_episode_however_close_to_the_last():
    """Two XID 79s 20 s apart with a repair passed between them (a compressed replay): the
    second one's condition starts at the second, so its pull is a new incident."""
    repaired = T0 + timedelta(seconds=10)
    verdict = judge(
        [xid(79, T0), xid(79, T0 + timedelta(seconds=20))], now=T0 + timedelta(minutes=1), cleared_at=repaired
    )
    (condition,) = [c for c in verdict.conditions if c.name == "xid_79"]
    assert condition.since == T0 + timedelta(seconds=20) and "1 event(s)" in condition.reason


def test_events_after_now_are_not_judged():
    assert judge([xid(79, T0 + timedelta(hours=1))], now=T0).action is Action.NONE


# ------------------------------------------------------------------ application XIDs and bursts


def test_a_thousand_application_xids_from_one_tenant_never_drain():
    rng = random.Random(7)
    now = T0 + timedelta(days=30)
    events = [
        xid(
            rng.choice(sorted(APPLICATION_XIDS)),
            T0 + timedelta(seconds=rng.uniform(0, 30 * 86_400)),
            gpu=rng.randrange(8),
            allocation=f"alloc-{rng.randrange(20)}",
        )
        for _ in range(1_000)
    ]

    verdict = judge(events, now=now)

    assert verdict.action is Action.NONE and verdict.health is Health.OK
    assert [c.name for c in verdict.conditions] == ["application_xids"]


def test_a_burst_of_one_xid_is_one_incident():
    burst = [xid(13, T0 + timedelta(seconds=s), gpu=s % 8) for s in range(0, 120, 3)]
    later = [xid(13, T0 + timedelta(minutes=30))]

    incidents = group_incidents(burst + later, window=timedelta(minutes=5))

    assert [len(i.events) for i in incidents] == [40, 1]
    assert incidents[0].gpu_indices == list(range(8))


def test_bursts_are_measured_from_their_first_event_so_a_trickle_is_not_one_endless_incident():
    trickle = [xid(43, T0 + timedelta(minutes=m)) for m in range(0, 60, 2)]

    incidents = group_incidents(trickle, window=timedelta(minutes=5))

    assert len(incidents) == 10


def test_bursts_from_two_tenants_are_two_incidents_and_do_not_escalate():
    events = [xid(13, T0 + timedelta(seconds=s), gpu=s % 8, tenant="tenant-a") for s in range(40)]
    events += [xid(13, T0 + timedelta(hours=5, seconds=s), gpu=s % 8, tenant="tenant-b") for s in range(40)]

    verdict = judge(events, now=T0 + timedelta(hours=6))

    assert verdict.action is Action.NONE


def test_application_xids_across_tenants_escalate_to_a_drain():
    events = [
        xid(13, T0, tenant="tenant-a"),
        xid(43, T0 + timedelta(hours=2), tenant="tenant-b"),
        xid(31, T0 + timedelta(hours=4), tenant="tenant-c"),
    ]

    verdict = judge(events, now=T0 + timedelta(hours=5))

    assert (verdict.health, verdict.action) == (Health.SUSPECT, Action.DRAIN)
    assert verdict.conditions[0].name == "application_xids_across_tenants"
    assert verdict.conditions[0].since == T0


def test_allocations_stand_in_for_unknown_tenants():
    events = [xid(13, T0 + timedelta(hours=h), tenant=None, allocation=f"alloc-{h}") for h in range(3)]

    assert judge(events, now=T0 + timedelta(hours=4)).action is Action.DRAIN


def test_application_escalation_looks_only_at_its_window_and_after_a_repair():
    events = [
        xid(13, T0, tenant="tenant-a"),
        xid(43, T0 + timedelta(hours=2), tenant="tenant-b"),
        xid(31, T0 + timedelta(hours=4), tenant="tenant-c"),
    ]

    assert judge(events, now=T0 + timedelta(days=8)).action is Action.NONE
    assert judge(events, now=T0 + timedelta(hours=5), cleared_at=T0 + timedelta(hours=1)).action is Action.NONE


application_xids = st.lists(
    st.tuples(
        st.sampled_from(sorted(APPLICATION_XIDS)),
        st.integers(0, 40 * 86_400),
        st.integers(0, 7),
        st.sampled_from([None, "alloc-1", "alloc-2", "alloc-3"]),
    ),
    max_size=200,
)


@settings(max_examples=150, deadline=None)
@given(application_xids, st.integers(0, 40 * 86_400), st.booleans())
def test_application_xids_within_one_tenant_never_drain(raw_events, now_s, with_clear):
    events = [xid(n, T0 + timedelta(seconds=s), gpu=g, tenant="tenant-a", allocation=a) for n, s, g, a in raw_events]
    now = T0 + timedelta(seconds=now_s)
    cleared_at = T0 + timedelta(seconds=now_s // 2) if with_clear else None

    verdict = judge(events, now=now, cleared_at=cleared_at)

    assert verdict.action not in DRAINING
    assert verdict.health is not Health.FAILED


# ------------------------------------------------------------------ counter trends


def ecc(corrected: int, uncorrected: int = 0) -> GpuReading:
    return gpu(ecc=EccCounts(volatile_corrected=corrected, volatile_uncorrected=uncorrected))


def names(verdict) -> set[str]:
    return {c.name for c in verdict.conditions}


def test_a_climbing_corrected_ecc_rate_raises_a_condition_before_anything_is_fatal():
    climbing = series(T0, [0, 200, 500, 900, 1400], ecc)  # 1,400 in 2 h: 700/h

    verdict = judge(readings=climbing, now=T0 + timedelta(hours=2))

    assert (verdict.health, verdict.action) == (Health.SUSPECT, Action.WATCH)
    condition = verdict.conditions[0]
    assert condition.name == "ecc_corrected_rate" and condition.gpu_index == 0
    assert condition.since == T0 + timedelta(minutes=30)


def test_a_slow_ecc_rate_and_a_counter_reset_raise_nothing():
    slow = series(T0, [0, 10, 20, 5, 15], ecc)  # the drop is a driver reload, not -15

    assert judge(readings=slow, now=T0 + timedelta(hours=2)).conditions == ()


def test_uncorrected_ecc_growth_is_raised():
    assert "ecc_uncorrected" in names(
        judge(readings=series(T0, [0, 0, 1], lambda v: ecc(0, v)), now=T0 + timedelta(hours=1))
    )


def test_two_close_readings_cannot_fake_a_high_rate():
    # 60 errors a minute apart would be 3,600/h; over the one-hour floor it is 60/h.
    quick = series(T0, [0, 60], ecc, step=timedelta(minutes=1))

    assert judge(readings=quick, now=T0 + timedelta(minutes=1)).conditions == ()


def rows(pending: bool = False, failure: bool = False, uncorrectable: int = 0) -> GpuReading:
    return gpu(remapped_rows=RemappedRows(correctable=0, uncorrectable=uncorrectable, pending=pending, failure=failure))


def test_remapped_rows_pending_and_failure():
    pending = judge(
        readings=series(T0, [False, True, True], lambda p: rows(pending=p, uncorrectable=int(p))),
        now=T0 + timedelta(hours=1),
    )
    assert {"row_remap_pending", "remapped_rows_uncorrectable"} <= names(pending)
    assert pending.action is Action.WATCH and pending.health is Health.SUSPECT

    failed = judge(readings=series(T0, [False, True], lambda f: rows(failure=f)), now=T0 + timedelta(hours=1))
    assert (failed.health, failed.action) == (Health.FAILED, Action.RMA)


def links(crc: int = 0, replay: int = 0, recovery: int = 0, second_active: bool = True) -> GpuReading:
    return gpu(
        nvlinks=(
            NvLinkReading(link=0, active=True, replay=replay, recovery=recovery, crc_flit=crc, crc_data=0),
            NvLinkReading(
                link=1,
                active=second_active,
                replay=0 if second_active else None,
                recovery=0 if second_active else None,
                crc_flit=0 if second_active else None,
                crc_data=0 if second_active else None,
            ),
        )
    )


def test_nvlink_error_growth_raises_conditions():
    crc = judge(readings=series(T0, [0, 150, 300], lambda v: links(crc=v, replay=v)), now=T0 + timedelta(hours=1))
    assert names(crc) == {"nvlink_error_rate"}

    recovery = judge(readings=series(T0, [0, 1, 2], lambda v: links(recovery=v)), now=T0 + timedelta(hours=1))
    assert names(recovery) == {"nvlink_recovery_rate"}


def test_a_link_going_down_drains_but_a_link_never_up_does_not():
    down = judge(readings=series(T0, [True, False], lambda up: links(second_active=up)), now=T0 + timedelta(hours=1))
    assert names(down) == {"nvlink_down"} and down.action is Action.DRAIN

    never = judge(readings=series(T0, [False, False], lambda up: links(second_active=up)), now=T0 + timedelta(hours=1))
    assert never.conditions == ()


def test_pcie_replay_growth_raises_a_condition():
    replays = series(T0, [0, 600, 1200], lambda v: gpu(pcie_replay=v))

    assert names(judge(readings=replays, now=T0 + timedelta(hours=1))) == {"pcie_replay_rate"}


def test_a_sustained_hardware_slowdown_raises_a_condition_and_a_blip_does_not():
    thermal = 0x40
    sustained = series(T0, [0, thermal, thermal, thermal], lambda m: gpu(clock_event_reasons=m))
    blip = series(T0, [thermal, 0, thermal, thermal], lambda m: gpu(clock_event_reasons=m))

    assert names(judge(readings=sustained, now=T0 + timedelta(hours=2))) == {"hardware_slowdown"}
    assert judge(readings=blip, now=T0 + timedelta(hours=2)).conditions == ()


def test_trends_before_a_repair_are_not_judged_again():
    climbing = series(T0, [0, 200, 500, 900, 1400], ecc)

    assert judge(readings=climbing, now=T0 + timedelta(hours=2), cleared_at=T0 + timedelta(hours=2)).conditions == ()


# ------------------------------------------------------------------ probe findings


def test_a_fatal_probe_reading_drains_now():
    lost = reading(T0, gpu(1), fatal=ProbeFatal(kind=FatalKind.GPU_LOST, gpu_index=0))

    verdict = judge(readings=[lost], now=T0 + timedelta(minutes=1))

    assert (verdict.health, verdict.action) == (Health.FAILED, Action.DRAIN_NOW)
    assert verdict.conditions[0].name == "probe_fatal" and verdict.conditions[0].gpu_index == 0


def test_a_driver_that_loads_late_is_not_held_against_the_node():
    booting = reading(T0, fatal=ProbeFatal(kind=FatalKind.DRIVER_NOT_LOADED))
    loaded = reading(T0 + timedelta(minutes=1), *(gpu(i) for i in range(8)))

    assert judge(readings=[booting], now=T0 + timedelta(seconds=30)).action is Action.DRAIN_NOW
    assert judge(readings=[booting, loaded], now=T0 + timedelta(minutes=2), expected_gpu_count=8).conditions == ()


def test_a_gpu_missing_from_the_bus_drains_now():
    readings = [
        reading(T0, *(gpu(i) for i in range(8))),
        reading(T0 + timedelta(minutes=1), *(gpu(i) for i in range(7))),
    ]

    verdict = judge(readings=readings, now=T0 + timedelta(minutes=2), expected_gpu_count=8)

    assert names(verdict) == {"gpu_missing"} and verdict.action is Action.DRAIN_NOW


# ------------------------------------------------------------------ the lemon rule


def test_a_second_fatal_episode_within_thirty_days_goes_to_rma():
    events = [xid(48, T0), xid(119, T0 + timedelta(days=10))]

    verdict = judge(events, now=T0 + timedelta(days=10, minutes=1), cleared_at=T0 + timedelta(days=1))

    assert (verdict.health, verdict.action) == (Health.FAILED, Action.RMA)
    assert verdict.conditions[0].name == "lemon"


def test_fatal_episodes_further_apart_than_the_window_are_reset_again():
    events = [xid(48, T0), xid(119, T0 + timedelta(days=40))]

    verdict = judge(events, now=T0 + timedelta(days=40, minutes=1), cleared_at=T0 + timedelta(days=1))

    assert verdict.action is Action.DRAIN


def test_a_lemon_already_repaired_is_not_sent_to_rma_again():
    events = [xid(48, T0), xid(119, T0 + timedelta(days=10))]

    verdict = judge(events, now=T0 + timedelta(days=12), cleared_at=T0 + timedelta(days=11))

    assert verdict.action is Action.NONE


def test_one_fault_cascading_into_several_fatal_signals_is_one_episode():
    at = T0 + timedelta(seconds=1)
    events = [xid(79, at, gpu=g) for g in range(8)] + [xid(119, at + timedelta(seconds=20))]
    lost = [
        reading(at + timedelta(seconds=s), fatal=ProbeFatal(kind=FatalKind.GPU_LOST, gpu_index=3)) for s in (30, 60, 90)
    ]

    verdict = judge(events, lost, now=T0 + timedelta(minutes=5))

    assert verdict.action is Action.DRAIN_NOW
    assert (
        len(fatal_episodes(group_incidents(events, window=timedelta(minutes=5)), lost, window=timedelta(minutes=5)))
        == 1
    )


def test_a_lost_gpu_twice_is_a_lemon_but_a_driver_mismatch_is_not_hardware():
    lost = ProbeFatal(kind=FatalKind.GPU_LOST, gpu_index=2)
    mismatch = ProbeFatal(kind=FatalKind.DRIVER_MISMATCH)
    healthy = reading(T0 + timedelta(days=1), gpu(0))

    twice = [reading(T0, fatal=lost), healthy, reading(T0 + timedelta(days=5), fatal=lost)]
    assert judge(readings=twice, now=T0 + timedelta(days=5), cleared_at=T0 + timedelta(days=2)).action is Action.RMA

    software = [reading(T0, fatal=mismatch), healthy, reading(T0 + timedelta(days=5), fatal=mismatch)]
    assert (
        judge(readings=software, now=T0 + timedelta(days=5), cleared_at=T0 + timedelta(days=2)).action
        is Action.DRAIN_NOW
    )


def test_the_lemon_threshold_is_configurable():
    events = [xid(48, T0), xid(119, T0 + timedelta(days=10))]
    policy = HealthPolicy(lemon_fatal_episodes=3)

    verdict = judge(events, now=T0 + timedelta(days=10, minutes=1), cleared_at=T0 + timedelta(days=1), policy=policy)

    assert verdict.action is Action.DRAIN


# ------------------------------------------------------------------ the circuit breaker


def test_the_breaker_trips_when_too_much_of_a_pool_is_pulled():
    breaker = CircuitBreaker(max_pulled_share=0.05, window=timedelta(hours=1))

    allowed = [
        breaker.request_quarantine(
            pool="h100-us", node_id=f"n{i}", pool_size=100, now=T0 + timedelta(minutes=i)
        ).allowed
        for i in range(5)
    ]
    refused = breaker.request_quarantine(pool="h100-us", node_id="n5", pool_size=100, now=T0 + timedelta(minutes=6))

    assert allowed == [True] * 5
    assert refused.allowed is False
    assert refused.alert.pool == "h100-us" and refused.alert.node_id == "n5" and refused.alert.pulled_in_window == 5
    assert "operator" in refused.alert.reason
    assert breaker.is_open(pool="h100-us", pool_size=100, now=T0 + timedelta(minutes=6))
    # Another pool is unaffected, and asking again for a node already pulled is not a new pull.
    assert breaker.request_quarantine(pool="h200-eu", node_id="m1", pool_size=100, now=T0).allowed
    assert breaker.request_quarantine(
        pool="h100-us", node_id="n0", pool_size=100, now=T0 + timedelta(minutes=7)
    ).allowed


def test_the_breaker_closes_as_pulls_age_out_or_when_an_operator_resets_it():
    breaker = CircuitBreaker(max_pulled_share=0.05, window=timedelta(hours=1))
    for i in range(5):
        breaker.request_quarantine(pool="p", node_id=f"n{i}", pool_size=100, now=T0)

    assert not breaker.request_quarantine(
        pool="p", node_id="late", pool_size=100, now=T0 + timedelta(minutes=59)
    ).allowed
    assert breaker.request_quarantine(pool="p", node_id="late", pool_size=100, now=T0 + timedelta(hours=1)).allowed

    for i in range(4):
        breaker.request_quarantine(pool="p", node_id=f"m{i}", pool_size=100, now=T0 + timedelta(hours=1))
    assert breaker.is_open(pool="p", pool_size=100, now=T0 + timedelta(hours=1))
    breaker.reset(pool="p")
    assert breaker.request_quarantine(
        pool="p", node_id="after-reset", pool_size=100, now=T0 + timedelta(hours=1)
    ).allowed


def test_a_small_pool_may_still_lose_its_one_broken_node():
    breaker = CircuitBreaker(max_pulled_share=0.05, min_pulls_allowed=1)

    assert breaker.request_quarantine(pool="tiny", node_id="n0", pool_size=4, now=T0).allowed
    assert not breaker.request_quarantine(pool="tiny", node_id="n1", pool_size=4, now=T0).allowed


def test_the_breaker_state_survives_serialisation():
    breaker = CircuitBreaker(max_pulled_share=0.05)
    for i in range(5):
        breaker.request_quarantine(pool="p", node_id=f"n{i}", pool_size=100, now=T0)

    restored = CircuitBreaker(
        max_pulled_share=0.05, state=BreakerState.model_validate_json(breaker.state.model_dump_json())
    )

    assert not restored.request_quarantine(pool="p", node_id="n5", pool_size=100, now=T0).allowed


def test_signals_beyond_xids_are_judged_with_the_xids_in_one_verdict():
    now = T0 + timedelta(hours=1)
    port_down = SignalObservation(signal=Signal.IB_LINK_DOWN, at=now - timedelta(minutes=5), source="mlx5_0/1")
    nccl = SignalObservation(signal=Signal.NCCL_TIMEOUT, at=now - timedelta(minutes=1), count=40)
    # An application XID and an NCCL timeout alone: the workload's faults, counted, never a drain.
    quiet = evaluate_node(events=[xid(13, now - timedelta(minutes=2))], readings=[], now=now, signals=[nccl])
    assert quiet.action not in DRAINING and {c.name for c in quiet.conditions} == {"application_xids", "nccl_timeout"}
    # A port that went down drains the node though no XID says so; it leads the conditions.
    verdict = evaluate_node(
        events=[xid(13, now - timedelta(minutes=2))], readings=[], now=now, signals=[nccl, port_down]
    )
    assert (verdict.health, verdict.action) == (Health.FAILED, Action.DRAIN)
    assert verdict.conditions[0].name == "ib_link_down" and "mlx5_0/1" in verdict.conditions[0].reason
    # A verified repair (a passed burn-in) after it clears it, as it clears XIDs.
    cleared = evaluate_node(events=[], readings=[], now=now, signals=[port_down], cleared_at=now - timedelta(minutes=3))
    assert cleared.action == Action.NONE and cleared.conditions == ()
