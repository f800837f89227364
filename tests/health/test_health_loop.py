"""The health loop against the real stack: XIDs in, the right action out; a bad node pulled from
its allocation and replaced in the same fabric domain; the repair ladder with burn-in as the
gate; the lemon rule; the circuit breaker; a degraded allocation that waits for capacity; a node
failing while it is provisioned; a burst of failures in one allocation; agents' readings; a
signal beyond XIDs (the simulated fleet's batch) pulling a node, an application one not."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import httpx
import pytest

from gpucloud.health.categories import FaultCategory
from gpucloud.protocol.reporter import ReportClient
from gpucloud.protocol.reports import FatalKind, ProbeFatal
from gpucloud.sim.fault_injection import FleetFaults
from gpucloud.sim.faults import FaultModel
from support.readings import node_reading
from support.stack import async_wait_until

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

FAST = {"latency_scale": 0.02, "health__drain_grace_s": 0.5, "health__replacement_recheck_s": 0.5}


async def _ready_fleet(ready_fleet, nodes: int, **settings):
    return await ready_fleet(nodes=nodes, **{**FAST, **settings})


def _xid(h, node_id: str, xid: int) -> dict:
    resp = h.operator.post(f"/v1/nodes/{node_id}/xid", json={"xid": xid, "gpu_index": 3})
    assert resp.status_code == 200, resp.text
    return resp.json()["decisions"][0]


def _hardware_fault(h, node_id: str, fault: str | None, fixed_by: str | None = None) -> None:
    h.sim.client.hardware_fault(node_id, fault, fixed_by=fixed_by)


def _events(h, node_id: str) -> list[dict]:
    return h.operator.get(f"/v1/nodes/{node_id}/events", params={"page_size": 500}).json()["items"]


async def _repair_round(h, temporal_env, node_id: str) -> str:
    """One reconciler sweep; wait for the node's repair workflow to finish; the node's state."""
    await h.sweep(temporal_env.client)
    await temporal_env.client.get_workflow_handle(f"node-{node_id}").result()
    return h.node(node_id)["state"]


async def test_each_xid_class_leads_to_its_action_and_application_xids_never_drain(ready_fleet):
    # Three fatal XIDs in one rack at once would be a fleet incident: here each node is judged alone.
    h = await _ready_fleet(
        ready_fleet, nodes=8, health__breaker_max_pulled_share=1.0, health__correlation_min_nodes=1000
    )
    ids = [n["id"] for n in h.nodes()]
    expected = {
        13: ("ok", "none", None),
        63: ("suspect", "watch", "drain"),  # idle with a row remap pending: reset before the next tenant
        92: ("ok", "watch", None),
        999: ("suspect", "watch", None),
        48: ("failed", "drain", "drain"),
        74: ("failed", "drain", "drain"),
        79: ("failed", "drain_now", "drain"),
    }
    for node_id, (xid, (health, action, pull)) in zip(ids, expected.items(), strict=False):
        decision = _xid(h, node_id, xid)
        assert (decision["health"], decision["action"], decision["pull"]) == (health, action, pull), xid
        report = h.operator.get(f"/v1/nodes/{node_id}/health").json()
        assert report["xid_history"][0]["xid"] == xid and report["health"] == health
    # Pulled idle nodes drain into quarantine (and from there into repair).
    pulled = [ids[1], ids[4], ids[5], ids[6]]
    await async_wait_until(
        lambda: all(any(e["to_state"] == "quarantined" for e in _events(h, n)) for n in pulled),
        timeout_s=60,
        what="pulled nodes quarantined",
    )

    # 1,000 application XIDs from one workload: counted, never a drain.
    now = datetime.now(UTC)
    quiet = ids[7]
    events = [
        {
            "node_id": quiet,
            "gpu_index": i % 8,
            "xid": (13, 31, 43, 45, 68)[i % 5],
            "timestamp": (now - timedelta(seconds=i)).isoformat(),
        }
        for i in range(1000)
    ]
    result = h.operator.post("/v1/agents/events", json={"events": events}).json()
    assert result["accepted"] == 1000
    assert [d["pull"] for d in result["decisions"]] == [None]
    node = h.node(quiet)
    assert node["state"] == "available" and node["health"] == "ok" and not node["drain_requested"]
    assert not any(e["event"] == "drain" for e in _events(h, quiet))


def _count(histogram: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(f"{histogram}_count") or 0.0


async def test_fatal_xid_on_active_node_replaced_in_same_pod_and_kept_out_until_burn_in_passes(
    ready_fleet, temporal_env
):
    h = await _ready_fleet(ready_fleet, nodes=6, health__breaker_max_pulled_share=1.0)
    tenant_id, key = await h.onboard()
    alloc_id = h.allocate(key, node_count=2)
    alloc = await h.wait_allocation(key, alloc_id, "ready")
    bad, kept = alloc["node_ids"]
    _hardware_fault(h, bad, "GPU 3 fell off the bus")  # no rung of the ladder fixes it

    # The API and the worker run in this process: their latency histograms are this registry's.
    cordoned, pulled = (
        _count("gpucloud_health_fault_to_cordon_seconds"),
        _count("gpucloud_health_fault_to_pulled_seconds"),
    )
    decision = _xid(h, bad, 79)
    assert (decision["action"], decision["pull"]) == ("drain_now", "replace")
    assert _count("gpucloud_health_fault_to_cordon_seconds") == cordoned + 1

    def replaced():
        a = h.client(key).get(f"/v1/allocations/{alloc_id}").json()
        return a["status"] == "ready" and bad not in a["node_ids"] and len(a["node_ids"]) == 2 and a

    alloc = await async_wait_until(replaced, timeout_s=60, what="replacement attached")
    assert _count("gpucloud_health_fault_to_pulled_seconds") == pulled + 1
    (new,) = set(alloc["node_ids"]) - {kept}
    nodes = {n["id"]: n for n in h.nodes()}
    assert nodes[new]["state"] == "active" and nodes[new]["allocation_id"] == alloc_id
    assert nodes[new]["pod"] == nodes[bad]["pod"] == alloc["fabric_domain"]
    assert h.sim.node(new)["tenant_id"] == tenant_id
    assert nodes[bad]["state"] == "quarantined" and nodes[bad]["allocation_id"] is None
    kinds = _alloc_events(h, key, alloc_id)
    assert kinds[0] == "degraded" and kinds[-2:] == ["replaced", "ready"]  # drain_now: no grace notice

    # The ladder: reset, reboot, reflash each fail burn-in; then the ladder is used up: RMA.
    states = [await _repair_round(h, temporal_env, bad) for _ in range(4)]
    assert states == ["quarantined", "quarantined", "quarantined", "rma"]
    after_xid = _events(h, bad)
    assert not any(
        e["to_state"] == "available"
        for e in after_xid[after_xid.index(next(e for e in after_xid if e["to_state"] == "draining")) :]
    )
    assert "ladder exhausted" in after_xid[-1]["cause"]


async def test_repaired_node_returns_only_through_a_passing_burn_in(ready_fleet, temporal_env):
    h = await _ready_fleet(ready_fleet, nodes=4)
    node_id = h.nodes()[0]["id"]
    _hardware_fault(h, node_id, "uncorrectable ECC", fixed_by="reboot")
    assert _xid(h, node_id, 48)["pull"] == "drain"
    await async_wait_until(lambda: h.node(node_id)["state"] == "quarantined", timeout_s=30, what="quarantined")
    assert await _repair_round(h, temporal_env, node_id) == "quarantined"  # reset: burn-in still fails
    assert await _repair_round(h, temporal_env, node_id) == "available"  # reboot fixed it
    node = h.node(node_id)
    assert node["health"] == "ok" and node["health_conditions"] == []
    events = _events(h, node_id)
    # (Without a BMC the wipe is in band, which the node's events say; the wipe's cleaning steps are
    # recorded too: neither is a move.)
    notes = {"inband_wipe_only", "gpu_reset", "disk_sanitized", "scratch_removed"}
    tail = [(e["from_state"], e["to_state"]) for e in events if e["event"] not in notes][-5:]
    assert tail == [
        ("quarantined", "repairing"),
        ("repairing", "wiping"),
        ("wiping", "burn_in"),
        ("burn_in", "available"),
        ("available", "available"),
    ]
    # The health loop cordoned the node when it pulled it; the passed burn-in lifts that cordon.
    assert [e["event"] for e in events if e["event"] in ("cordon", "uncordon")] == ["cordon", "uncordon"]
    assert events[-1]["actor"] == "health" and not node["cordoned"]


async def test_lemon_node_goes_to_rma_without_another_reset(ready_fleet, temporal_env):
    h = await _ready_fleet(ready_fleet, nodes=4)
    node_id = h.nodes()[0]["id"]
    earlier = datetime.now(UTC) - timedelta(days=10)
    h.operator.post(
        "/v1/agents/events",
        json={"events": [{"node_id": node_id, "gpu_index": 1, "xid": 119, "timestamp": earlier.isoformat()}]},
    ).raise_for_status()
    decision = _xid(h, node_id, 79)
    assert (decision["action"], decision["pull"]) == ("rma", "drain")
    await async_wait_until(lambda: h.node(node_id)["state"] == "quarantined", timeout_s=30, what="quarantined")
    assert await _repair_round(h, temporal_env, node_id) == "rma"
    last = _events(h, node_id)[-1]
    assert (last["from_state"], last["to_state"]) == ("repairing", "rma") and "lemon" in last["cause"]


async def test_circuit_breaker_refuses_pulls_beyond_the_pool_share(ready_fleet):
    h = await _ready_fleet(ready_fleet, nodes=8)  # 5 % of 8: one pull an hour
    first, second = [n["id"] for n in h.nodes()[:2]]
    assert _xid(h, first, 79)["pull"] == "drain"
    refused = _xid(h, second, 79)
    assert refused["pull"] is None and "refused" in refused["alert"]
    alerts = h.operator.get("/v1/alerts").json()["items"]
    assert [(a["kind"], a["node_id"], a["pool"]) for a in alerts] == [("circuit_breaker", second, "H100/us-east-1")]
    node = h.node(second)
    assert node["health"] == "failed" and not node["drain_requested"] and node["state"] == "available"
    _, key = await h.onboard()
    with h.client(key) as c:
        assert c.get("/v1/alerts").status_code == 403


async def test_no_capacity_degraded_until_capacity_frees(ready_fleet):
    h = await _ready_fleet(ready_fleet, nodes=3, health__breaker_max_pulled_share=1.0)
    _, key = await h.onboard()
    _, other_key = await h.onboard()
    alloc_id = h.allocate(key, node_count=2)
    other_id = h.allocate(other_key, node_count=1)
    alloc = await h.wait_allocation(key, alloc_id, "ready")
    await h.wait_allocation(other_key, other_id, "ready")
    bad = alloc["node_ids"][0]
    decision = _xid(h, bad, 48)  # double-bit ECC: drain after the grace period
    assert (decision["action"], decision["pull"]) == ("drain", "replace")

    degraded = await async_wait_until(
        lambda: (
            (a := h.client(key).get(f"/v1/allocations/{alloc_id}").json())["status"] == "degraded"
            and "waiting for capacity" in (a["failure_reason"] or "")
            and a
        ),
        timeout_s=30,
        what="degraded",
    )
    assert bad not in degraded["node_ids"] and "xid_48" in degraded["failure_reason"]
    with h.client(other_key) as c:  # another tenant sees nothing of it
        assert c.get(f"/v1/allocations/{alloc_id}/events").status_code == 404

    with h.client(other_key) as c:
        c.post(f"/v1/allocations/{other_id}/cancel").raise_for_status()
    await h.wait_allocation(key, alloc_id, "ready", timeout_s=60)
    kinds = _alloc_events(h, key, alloc_id)
    assert kinds == ["fault_notice", "degraded", "waiting_for_capacity", "replacement_started", "replaced", "ready"]


# What the tenant asked for (and who asked) is recorded too, and the allocation's own life (its
# nodes provisioning, its first ready, its release); these tests follow the health loop's.
REQUESTS = {"requested", "cancel_requested", "provisioning", "released"}
FIRST_READY = "every node provisioned"


def _alloc_events(h, key: str, alloc_id: str) -> list[str]:
    """The allocation's events the health loop recorded, in order."""
    with h.client(key) as c:
        items = c.get(f"/v1/allocations/{alloc_id}/events").json()["items"]
    return [e["kind"] for e in items if e["kind"] not in REQUESTS and e["reason"] != FIRST_READY]


async def test_fatal_xid_while_provisioning_is_replaced_before_the_allocation_is_ready(ready_fleet, tmp_path):
    from support.ledger_auth import auth_for
    from support.ledger_harness import ledger_in_thread

    with ledger_in_thread(f"sqlite:///{tmp_path / 'ledger.db'}", issuer_dir=tmp_path) as ledger_url:
        await _replaced_before_ready(ready_fleet, ledger_url, auth_for(ledger_url))


async def _replaced_before_ready(ready_fleet, ledger_url, ledger_auth) -> None:
    h = await _ready_fleet(
        ready_fleet,
        nodes=4,
        health__breaker_max_pulled_share=1.0,
        ledger={"url": ledger_url},
    )
    for node in h.nodes():  # every provision answers 503 twice first: about 3 s in `provisioning`
        h.sim.inject(node["id"], "provision", "transient", count=2)
    tenant_id, key = await h.onboard()
    with h.client(key) as c:
        created = c.post("/v1/allocations", json={"gpu_type": "H100", "node_count": 2, "region": "us-east-1"}).json()
    alloc_id, operation_id = created["allocation"]["id"], created["operation"]["id"]
    bad = (
        await async_wait_until(
            lambda: [n for n in h.nodes() if n["allocation_id"] == alloc_id and n["state"] == "provisioning"],
            timeout_s=30,
            what="a node provisioning",
        )
    )[0]["id"]

    decision = _xid(h, bad, 48)  # drain-level, yet no grace: no job runs there yet
    assert (decision["action"], decision["pull"]) == ("drain", "replace")

    alloc = await h.wait_allocation(key, alloc_id, "ready", timeout_s=60)
    assert bad not in alloc["node_ids"] and len(alloc["node_ids"]) == 2
    # Never `ready` with the bad node: pulled and replaced first, then ready once; the tenant's
    # create operation succeeded only then.
    assert _alloc_events(h, key, alloc_id) == ["degraded", "replacement_started", "replaced", "ready"]
    with h.client(key) as c:
        items = c.get(f"/v1/allocations/{alloc_id}/events").json()["items"]
        replaced_at = next(e["at"] for e in items if e["kind"] == "replaced")
        operation = c.get(f"/v1/operations/{operation_id}").json()
    assert operation["status"] == "succeeded"
    assert datetime.fromisoformat(operation["updated_at"]) >= datetime.fromisoformat(replaced_at)
    nodes = {n["id"]: n for n in h.nodes()}
    assert all(nodes[n]["state"] == "active" and nodes[n]["pod"] == alloc["fabric_domain"] for n in alloc["node_ids"])
    assert all(h.sim.node(n)["tenant_id"] == tenant_id for n in alloc["node_ids"])
    await async_wait_until(lambda: h.node(bad)["state"] == "quarantined", timeout_s=30, what="bad node quarantined")
    # Billed: the two nodes the tenant got at ready, never the one pulled before it.
    params = {"tenant_id": tenant_id, "allocation_id": alloc_id}

    def added() -> set[str] | None:
        events = httpx.get(f"{ledger_url}/v1/allocation-events", params=params, auth=ledger_auth).json()
        found = {e["node_id"] for e in events if e["kind"] == "node_added"}
        return found if len(found) >= 2 else None

    assert await async_wait_until(added, timeout_s=30, what="the ledger's node_added events") == set(alloc["node_ids"])


async def test_a_burst_of_fatal_xids_in_one_allocation_pulls_all_and_replaces_each(ready_fleet, temporal_env):
    h = await _ready_fleet(ready_fleet, nodes=4, health__breaker_max_pulled_share=1.0)
    tenant_id, key = await h.onboard()
    alloc_id = h.allocate(key, node_count=3)  # one spare node left
    alloc = await h.wait_allocation(key, alloc_id, "ready")
    first, second, kept = alloc["node_ids"]
    now = datetime.now(UTC).isoformat()
    result = h.operator.post(
        "/v1/agents/events",
        json={"events": [{"node_id": n, "gpu_index": 0, "xid": 79, "timestamp": now} for n in (first, second)]},
    ).json()
    assert [d["pull"] for d in result["decisions"]] == ["replace", "replace"]

    # Both pulled at once; the spare replaces one, the other waits for capacity.
    degraded = await async_wait_until(
        lambda: (
            (a := h.client(key).get(f"/v1/allocations/{alloc_id}").json())["status"] == "degraded"
            and "waiting for capacity" in (a["failure_reason"] or "")
            and a
        ),
        timeout_s=60,
        what="waiting for capacity",
    )
    assert kept in degraded["node_ids"] and len(degraded["node_ids"]) == 2
    assert not {first, second} & set(degraded["node_ids"])

    # Capacity frees: a pulled node passes its repair and burn-in and comes back.
    await async_wait_until(
        lambda: all(h.node(n)["state"] == "quarantined" for n in (first, second)), timeout_s=30, what="both quarantined"
    )
    await h.sweep(temporal_env.client)
    alloc = await h.wait_allocation(key, alloc_id, "ready", timeout_s=60)
    assert len(alloc["node_ids"]) == 3 and kept in alloc["node_ids"]
    assert all(h.node(n)["state"] == "active" and h.sim.node(n)["tenant_id"] == tenant_id for n in alloc["node_ids"])
    assert _alloc_events(h, key, alloc_id) == [
        "degraded",
        "degraded",
        "replacement_started",
        "replaced",
        "waiting_for_capacity",
        "replacement_started",
        "replaced",
        "ready",
    ]


async def test_agent_readings_are_validated_judged_and_acted_on(ready_fleet):
    h = await _ready_fleet(ready_fleet, nodes=2)
    watched, lost = [n["id"] for n in h.nodes()]
    now = datetime.now(UTC)

    def push(*readings) -> httpx.Response:
        return h.operator.post(
            "/v1/agents/readings",
            json={"readings": [r if isinstance(r, dict) else r.model_dump(mode="json") for r in readings]},
        )

    negative = node_reading(watched, now).model_dump(mode="json")
    negative["gpus"][0]["ecc"]["volatile_corrected"] = -1
    bad = push(negative)
    assert bad.status_code == 422 and bad.headers["content-type"] == "application/problem+json"
    assert [e["field"] for e in bad.json()["errors"]] == ["readings.0.gpus.0.ecc.volatile_corrected"]
    missing = node_reading(watched, now).model_dump(mode="json")
    del missing["timestamp"]
    assert [e["field"] for e in push(missing).json()["errors"]] == ["readings.0.timestamp"]
    ahead = push(node_reading(watched, now), node_reading(watched, now + timedelta(hours=1)))
    assert ahead.status_code == 422 and [e["field"] for e in ahead.json()["errors"]] == ["readings.1.timestamp"]
    assert push().json()["errors"][0]["field"] == "readings"
    unknown = push(node_reading(watched, now), node_reading("ghost", now))
    assert unknown.status_code == 404 and unknown.json()["unknown_nodes"] == ["ghost"]
    assert h.operator.get(f"/v1/nodes/{watched}/health").json()["readings"] == []  # nothing stored
    _, key = h.new_tenant()
    with h.client(key) as c:
        assert (
            c.post(
                "/v1/agents/readings", json={"readings": [node_reading(watched, now).model_dump(mode="json")]}
            ).status_code
            == 403
        )

    # Corrected ECC errors climbing since the node's burn-in (what came before it is dealt with):
    # a warning, and the node stays.
    burned_in = datetime.fromisoformat(_events(h, watched)[-1]["at"])
    rising = push(
        node_reading(watched, burned_in + timedelta(milliseconds=1)),
        node_reading(watched, burned_in + timedelta(milliseconds=2), corrected=500),
        node_reading(watched, burned_in + timedelta(milliseconds=3), corrected=1000),
    ).json()
    assert rising["accepted"] == 3
    assert [(d["health"], d["action"], d["pull"]) for d in rising["decisions"]] == [("suspect", "watch", None)]
    report = h.operator.get(f"/v1/nodes/{watched}/health", params={"reading_limit": 5}).json()
    assert [c["name"] for c in report["conditions"]] == ["ecc_corrected_rate"]
    assert [r["gpus"][2]["ecc"]["volatile_corrected"] for r in report["readings"]] == [1000, 500, 0]

    # A GPU lost: pulled now, and drained into quarantine.
    gone = ProbeFatal(kind=FatalKind.GPU_LOST, gpu_index=4, detail="GPU has fallen off the bus")
    (decision,) = push(node_reading(lost, now, fatal=gone)).json()["decisions"]
    assert (decision["health"], decision["action"], decision["pull"]) == ("failed", "drain_now", "drain")
    await async_wait_until(lambda: h.node(lost)["state"] == "quarantined", timeout_s=30, what="quarantined")


async def test_a_lost_replace_signal_is_sent_again_by_the_reconciler(ready_fleet, temporal_env):
    # The API judged the node and then died before it could signal the allocation's workflow:
    # only the DB knows. The reconciler derives the pull from the record and asks again.
    from gpucloud.db import session_scope
    from gpucloud.protocol.reports import XidEvent
    from gpucloud.services import health as health_service

    h = await _ready_fleet(ready_fleet, nodes=3, health__breaker_max_pulled_share=1.0)
    _, key = await h.onboard()
    alloc_id = h.allocate(key, node_count=2)
    ready = await h.wait_allocation(key, alloc_id, "ready", timeout_s=60)
    bad = ready["node_ids"][0]
    with session_scope(h.settings.database_url) as session:
        outcomes, _ = health_service.ingest_xids(
            session,
            [XidEvent(node_id=bad, gpu_index=3, xid=79, timestamp=datetime.now(UTC))],
            source="test",
            breaker=health_service.BreakerSettings(max_pulled_share=1.0),
        )
    assert outcomes[0].pull == "replace"  # decided, but no signal went out
    assert h.node(bad)["allocation_id"] == alloc_id

    result = await h.sweep(temporal_env.client)
    assert result.replace_signals == 1
    await async_wait_until(
        lambda: (
            (a := h.client(key).get(f"/v1/allocations/{alloc_id}").json())["status"] == "ready"
            and bad not in a["node_ids"]
            and a
        ),
        timeout_s=60,
        what="the bad node replaced",
    )
    assert h.node(bad)["allocation_id"] is None
    # Converged: the next sweep has nothing to send.
    assert (await h.sweep(temporal_env.client)).replace_signals == 0


async def test_a_replacement_tells_the_ledger_which_node_left_and_which_joined(ready_fleet, tmp_path):
    # The ledger reconciles metered time against allocated time per node: a pulled node stops
    # counting when it is detached, its replacement counts from when it is attached.
    from support.ledger_auth import auth_for
    from support.ledger_harness import ledger_in_thread

    # The control plane's data dir holds the key the ledger trusts (the harness's is tmp_path).
    with ledger_in_thread(f"sqlite:///{tmp_path / 'ledger.db'}", issuer_dir=tmp_path) as ledger_url:
        h = await _ready_fleet(
            ready_fleet,
            nodes=3,
            health__breaker_max_pulled_share=1.0,
            ledger__url=ledger_url,
        )
        tenant_id, key = await h.onboard()
        alloc_id = h.allocate(key, node_count=2)
        ready = await h.wait_allocation(key, alloc_id, "ready", timeout_s=60)
        bad = ready["node_ids"][0]
        assert _xid(h, bad, 79)["pull"] == "replace"

        def events() -> list[dict]:
            return httpx.get(
                f"{ledger_url}/v1/allocation-events",
                params={"tenant_id": tenant_id, "allocation_id": alloc_id},
                auth=auth_for(ledger_url),
            ).json()

        def replaced() -> dict | None:
            a = h.client(key).get(f"/v1/allocations/{alloc_id}").json()
            return a if a["status"] == "ready" and bad not in a["node_ids"] else None

        after = await async_wait_until(replaced, timeout_s=60, what="the bad node replaced")
        (spare,) = set(after["node_ids"]) - set(ready["node_ids"])
        got = await async_wait_until(
            lambda: (e := events()) and any(x["kind"] == "node_added" and x["node_id"] == spare for x in e) and e,
            timeout_s=30,
            what="the ledger hears of the replacement",
        )
        kinds = [(e["kind"], e["node_id"]) for e in sorted(got, key=lambda e: (e["at_ms"], e["id"]))]
        assert ("node_removed", bad) in kinds and ("node_added", spare) in kinds
        assert kinds.index(("node_removed", bad)) < kinds.index(("node_added", spare))


async def test_a_fault_while_a_replacement_provisions_is_pulled_at_once(ready_fleet):
    h = await _ready_fleet(ready_fleet, nodes=5, health__breaker_max_pulled_share=1.0)
    _, key = await h.onboard()
    alloc_id = h.allocate(key, node_count=3)
    alloc = await h.wait_allocation(key, alloc_id, "ready")
    first, second, kept = alloc["node_ids"]
    for node in h.nodes():  # every later provision answers 503 three times first: ~7 s in `provisioning`
        if node["id"] not in alloc["node_ids"]:
            h.sim.inject(node["id"], "provision", "transient", count=3)
    _xid(h, first, 79)
    await async_wait_until(
        lambda: "replacement_started" in _alloc_events(h, key, alloc_id),
        timeout_s=30,
        what="the first replacement provisioning",
    )
    _xid(h, second, 79)
    # The second node leaves the allocation while the first replacement still provisions, not after it.
    events = await async_wait_until(
        lambda: (kinds := _alloc_events(h, key, alloc_id)).count("degraded") == 2 and kinds,
        timeout_s=30,
        what="the second node pulled",
    )
    assert events == ["degraded", "replacement_started", "degraded"]
    assert second not in h.client(key).get(f"/v1/allocations/{alloc_id}").json()["node_ids"]
    alloc = await h.wait_allocation(key, alloc_id, "ready", timeout_s=60)
    assert _alloc_events(h, key, alloc_id) == [
        "degraded",
        "replacement_started",
        "degraded",
        "replaced",
        "replacement_started",
        "replaced",
        "ready",
    ]
    assert kept in alloc["node_ids"] and not {first, second} & set(alloc["node_ids"]) and len(alloc["node_ids"]) == 3


async def test_a_cancel_waits_for_the_pulled_nodes_drain(ready_fleet):
    h = await _ready_fleet(ready_fleet, nodes=2, health__breaker_max_pulled_share=1.0)
    _, key = await h.onboard()
    alloc_id = h.allocate(key, node_count=2)
    bad, _kept = (await h.wait_allocation(key, alloc_id, "ready"))["node_ids"]
    h.sim.inject(bad, "release", "transient", count=2)  # its drain takes a few seconds of retries
    _xid(h, bad, 79)
    await async_wait_until(lambda: "degraded" in _alloc_events(h, key, alloc_id), timeout_s=30, what="pulled")
    await async_wait_until(lambda: h.node(bad)["state"] == "draining", timeout_s=10, what="draining")
    with h.client(key) as c:
        c.post(f"/v1/allocations/{alloc_id}/cancel").raise_for_status()
    await h.wait_allocation(key, alloc_id, "released", timeout_s=60)
    # The drain ran behind the replacement search, yet finished before the allocation's run did
    # (a run that ends terminates its children): the bad node is quarantined, not stuck draining.
    assert h.node(bad)["state"] == "quarantined"
    assert [(e["from_state"], e["to_state"]) for e in _events(h, bad)][-2:] == [
        ("active", "draining"),
        ("draining", "quarantined"),
    ]


def _signal_report(node_id: str, *signals: str, at: datetime | None = None, source: str = "mlx5_0/1") -> dict:
    at = at or datetime.now(UTC)
    return {
        "node_id": node_id,
        "at": at.isoformat(),
        "observations": [{"signal": s, "at": at.isoformat(), "source": source} for s in signals],
    }


async def test_a_signal_without_an_xid_pulls_a_node_from_its_allocation_and_an_application_signal_does_not(
    ready_fleet,
):
    h = await _ready_fleet(ready_fleet, nodes=4, health__breaker_max_pulled_share=1.0)
    _, key = await h.onboard()
    alloc_id = h.allocate(key, node_count=2)
    alloc = await h.wait_allocation(key, alloc_id, "ready")
    bad, kept = alloc["node_ids"]
    _hardware_fault(h, bad, "network: fabric_link_down")  # a cable: no rung of the ladder fixes it

    # Refused before anything is stored: a moment ahead of the clock, no report, a tenant.
    ahead = _signal_report(bad, "ib_link_down", at=datetime.now(UTC) + timedelta(hours=1))
    refused = h.operator.post("/v1/agents/signals", json={"reports": [ahead]})
    assert refused.status_code == 422 and refused.json()["errors"][0]["field"] == "reports.0.at"
    empty = h.operator.post("/v1/agents/signals", json={"reports": []})
    assert empty.status_code == 422 and empty.json()["errors"][0]["field"] == "reports"
    with h.client(key) as c:
        assert c.post("/v1/agents/signals", json={"reports": [_signal_report(bad, "ib_link_down")]}).status_code == 403
    assert h.operator.get(f"/v1/nodes/{bad}/health").json()["signal_history"] == []

    # The batch form, as the simulated fleet posts it: a port down on one node, an NCCL timeout
    # on the other (`sim/fault_injection.py`: the host conditions' signals, no XID).
    faults = FleetFaults(
        {n: SimpleNamespace(id=n, gpu_count=8, hardware_fault=None, credential=None) for n in (bad, kept)},
        control_plane_url=h.api.url,
        operator_token=h.settings.operator_token,
    )
    for node_id, category, condition in (
        (bad, FaultCategory.NETWORK, "fabric_link_down"),
        (kept, FaultCategory.NCCL_WATCHDOG, "nccl_watchdog_timeout"),
    ):
        drawn = FaultModel(mix={category: 1}).next_faults([node_id], 1e9, random.Random(4))
        faults._apply(next(f for f in drawn if f.host_condition == condition))
    async with httpx.AsyncClient(timeout=30) as client:
        await faults.report_signals(ReportClient(client, h.api.url))
    assert faults.summary()["signals_reported"] == 4 and faults.xids_reported == 0

    def replaced():
        a = h.client(key).get(f"/v1/allocations/{alloc_id}").json()
        return a["status"] == "ready" and bad not in a["node_ids"] and len(a["node_ids"]) == 2 and a

    alloc = await async_wait_until(replaced, timeout_s=60, what="replacement attached")
    assert kept in alloc["node_ids"]
    assert _alloc_events(h, key, alloc_id)[-2:] == ["replaced", "ready"]
    report = h.operator.get(f"/v1/nodes/{bad}/health").json()
    assert report["health"] == "failed" and report["conditions"][0]["name"] == "ib_link_down"
    assert report["xid_history"] == []
    assert {s["signal"] for s in report["signal_history"]} == {"ib_link_down", "ib_link_downed"}
    assert all(s["reported_by"].startswith("operator:") for s in report["signal_history"])
    assert h.node(bad)["cordoned"] and h.node(bad)["allocation_id"] is None
    quiet = h.operator.get(f"/v1/nodes/{kept}/health").json()
    assert {c["name"] for c in quiet["conditions"]} == {"nccl_timeout", "workload_hang"}
    assert quiet["health"] == "ok" and not h.node(kept)["cordoned"] and h.node(kept)["state"] == "active"


async def test_a_failed_leaf_switch_is_one_fleet_incident_and_its_nodes_are_neither_replaced_nor_power_cycled(
    ready_fleet, temporal_env
):
    # A grace period long enough that the first nodes' reports (before the burst shows) wait it out.
    h = await _ready_fleet(
        ready_fleet,
        nodes=8,
        health__breaker_max_pulled_share=1.0,
        health__drain_grace_s=4,
        health__incident_poll_s=0.2,
    )
    tenant_id, key = await h.onboard()
    alloc_id = h.allocate(key, node_count=4)
    alloc = await h.wait_allocation(key, alloc_id, "ready")
    members = sorted(alloc["node_ids"])
    switches = {h.node(n)["leaf_switch"] for n in members}
    assert len(switches) == 1 and None not in switches  # enrolled from the simulated fleet's inventory
    (switch,) = switches
    assert all(h.node(n)["pdu"] for n in members)

    # The switch fails: every node behind it reports its ports down, one agent after another.
    failed = h.sim.client.switch_down(switch)
    assert sorted(failed["nodes"]) == members and failed["reported"] == 4
    (incident,) = h.operator.get("/v1/fleet-incidents", params={"status": "open"}).json()["items"]
    assert (incident["component_kind"], incident["component_id"]) == ("leaf_switch", switch)
    assert incident["node_ids"] == members
    (alert,) = [a for a in h.operator.get("/v1/alerts").json()["items"] if a["kind"] == "fleet_incident"]
    # One alert, when the burst showed (the nodes so far); the incident it names gathers the rest.
    assert f"leaf switch {switch}" in alert["reason"] and incident["id"] in alert["reason"]
    assert sum(n in alert["reason"] for n in members) >= 3

    # One incident of kind fleet, the switch its suspected component, open while the switch is down.
    (fleet,) = h.operator.get("/v1/incidents", params={"kind": "fleet"}).json()["items"]
    assert (fleet["fleet_incident_id"], fleet["trigger"], fleet["status"]) == (
        incident["id"],
        "correlated_burst",
        "open",
    )
    assert (fleet["suspected_component"], fleet["category"]) == (f"leaf switch {switch}", "network")

    # Past the grace period and a sweep: nothing replaced, drained, repaired or power-cycled.
    await asyncio.sleep(5)
    await h.sweep(temporal_env.client)
    alloc = h.client(key).get(f"/v1/allocations/{alloc_id}").json()
    assert sorted(alloc["node_ids"]) == members and alloc["status"] == "ready"
    assert "replaced" not in _alloc_events(h, key, alloc_id)
    for node_id in members:
        node = h.node(node_id)
        assert (node["state"], node["cordoned"], node["fleet_incident_id"]) == ("active", True, incident["id"])
        assert not {"drain", "repair", "power_cycle"} & {e["event"] for e in _events(h, node_id)}

    # The operator fixes the switch and resolves the incident: the nodes are judged normally again.
    h.sim.client.switch_up(switch)
    resolved = h.operator.post(f"/v1/fleet-incidents/{incident['id']}:resolve", json={"note": "leaf replaced"})
    assert resolved.status_code == 200, resolved.text
    body = resolved.json()
    assert body["incident"]["status"] == "resolved" and body["incident"]["resolution"] == "leaf replaced"
    assert {(d["health"], d["pull"]) for d in body["decisions"]} == {("ok", None)}
    for node_id in members:
        node = h.node(node_id)
        assert (node["state"], node["cordoned"], node["fleet_incident_id"], node["health"]) == (
            "active",
            False,
            None,
            "ok",
        )
    assert h.operator.post("/v1/fleet-incidents/fi-nope:resolve").status_code == 404

    # Its incident goes through the phases to its write-up once every node is back.
    def written_up():
        found = h.operator.get(f"/v1/incidents/{fleet['id']}").json()
        return found["phase"] == "closed" and found

    fleet = await async_wait_until(written_up, timeout_s=30, what="fleet incident written up")
    assert (fleet["status"], fleet["repaired_by"], fleet["node_ids"]) == ("resolved", "leaf replaced", members)
    assert all(fleet[f"{p}_at"] for p in ("detected", "stabilized", "diagnosed", "repaired", "gated", "closed"))
    assert [i["id"] for i in h.operator.get("/v1/incidents", params={"kind": "fleet"}).json()["items"]] == [fleet["id"]]
    text = h.operator.get(f"/v1/incidents/{fleet['id']}/write-up").text
    assert f"leaf switch {switch}" in text and "leaf replaced" in text and "tenants kept their nodes" in text
    # Resolving it again through its incident changes nothing.
    again = h.operator.post(f"/v1/incidents/{fleet['id']}:resolve", json={"note": "again"})
    assert again.status_code == 200 and again.json()["repaired_by"] == "leaf replaced"
    # The tenant whose allocation it touched sees it, as its own.
    (mine,) = h.client(key).get("/v1/incidents", params={"kind": "fleet"}).json()["items"]
    assert mine["id"] == fleet["id"] and mine["tenant_ids"] == [tenant_id] and mine["allocation_ids"] == [alloc_id]
