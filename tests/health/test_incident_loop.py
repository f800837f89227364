"""Issue 42, the incident record, against the real stack (API, worker, simulated fleet): a fatal XID
on an allocated node opens one incident, which goes detected -> stabilized (pulled, and the
allocation whole again) -> diagnosed -> repaired (the rung that fixed it) -> gated (burn-in
passed) and is written up; the tenant it touched reads it without anything of another tenant's,
another tenant does not see it, and an operator writes its root cause."""

from __future__ import annotations

from datetime import datetime

import pytest

from support.stack import async_wait_until

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

FAST = {
    "latency_scale": 0.02,
    "health__drain_grace_s": 0.5,
    "health__replacement_recheck_s": 0.5,
    "health__breaker_max_pulled_share": 1.0,
    "health__incident_poll_s": 0.2,
}


def _at(value: str | None) -> datetime:
    assert value is not None
    return datetime.fromisoformat(value)


async def test_a_fatal_xid_on_an_allocated_node_is_one_incident_from_detection_to_gate(
    ready_fleet, temporal_env
) -> None:
    h = await ready_fleet(nodes=4, **FAST)
    tenant_id, key = await h.onboard()
    _, other_key = await h.onboard()
    alloc_id = h.allocate(key, node_count=2)
    alloc = await h.wait_allocation(key, alloc_id, "ready")
    bad = alloc["node_ids"][0]
    h.sim.client.hardware_fault(bad, "GPU 3 fell off the bus", fixed_by="reset")

    resp = h.operator.post(f"/v1/nodes/{bad}/xid", json={"xid": 79, "gpu_index": 3})
    assert resp.status_code == 200 and resp.json()["decisions"][0]["pull"] == "replace", resp.text

    def opened():
        items = h.operator.get("/v1/incidents", params={"node_id": bad}).json()["items"]
        return items[0] if items else None

    incident = await async_wait_until(opened, timeout_s=30, what="incident opened")
    incident_id = incident["id"]
    assert incident["id"].startswith("inc_") and incident["status"] == "open"
    assert (incident["category"], incident["suspected_component"]) == ("faulty_gpu", "GPU 3")
    assert incident["tenant_ids"] == [tenant_id] and incident["allocation_ids"] == [alloc_id]

    def stabilized():
        found = h.operator.get(f"/v1/incidents/{incident_id}").json()
        return found["stabilized_at"] and found

    incident = await async_wait_until(stabilized, timeout_s=60, what="allocation whole again")
    assert incident["replacement_node_ids"] and incident["replacement_node_ids"][0] != bad

    # The repair: the reconciler takes the quarantined node up the ladder; reset fixes it.
    await async_wait_until(lambda: h.node(bad)["state"] == "quarantined", timeout_s=60, what="quarantined")
    await h.sweep(temporal_env.client)
    await temporal_env.client.get_workflow_handle(f"node-{bad}").result()
    assert h.node(bad)["state"] == "available"

    def closed():
        found = h.operator.get(f"/v1/incidents/{incident_id}").json()
        return found["status"] != "open" and found

    incident = await async_wait_until(closed, timeout_s=60, what="incident closed")
    assert (incident["status"], incident["phase"], incident["repaired_by"]) == ("resolved", "closed", "reset")
    moments = [
        _at(incident[f"{phase}_at"])
        for phase in ("detected", "pulled", "stabilized", "diagnosed", "repaired", "gated", "closed")
    ]
    assert moments == sorted(moments)
    assert incident["gpu_hours_lost"] > 0
    assert any(s["name"] == "xid_79" for s in incident["signals"])
    assert [a["to"] for a in incident["actions"]][-1] == "available"
    # What was done about it starts at the pull, not with the node's bring-up minutes before.
    assert min(_at(a["at"]) for a in incident["actions"]) >= _at(incident["pulled_at"])
    assert not any(a["event"] in ("inspect", "bmc_discover", "power_on") for a in incident["actions"])

    # The re-sent pull (the reconciler's sweep, the XID again) opens no second incident.
    assert len(h.operator.get("/v1/incidents", params={"node_id": bad}).json()["items"]) == 1

    write_up = h.operator.get(f"/v1/incidents/{incident_id}/write-up")
    assert write_up.status_code == 200 and write_up.headers["content-type"].startswith("text/markdown")
    for part in ("## Timeline", "## Impact", f"**Tenants touched**: {tenant_id}", "The `reset` rung"):
        assert part in write_up.text

    # The tenant touched reads it; another tenant neither lists nor reads it.
    with h.client(key) as c:
        mine = c.get("/v1/incidents").json()["items"]
        assert [i["id"] for i in mine] == [incident_id] and mine[0]["tenant_ids"] == [tenant_id]
        assert c.get(f"/v1/incidents/{incident_id}/write-up").status_code == 200
        assert c.post(f"/v1/incidents/{incident_id}/root-cause", json={"root_cause": "x"}).status_code == 403
    with h.client(other_key) as c:
        assert c.get("/v1/incidents").json()["items"] == []
        assert c.get(f"/v1/incidents/{incident_id}").status_code == 404
        assert c.get(f"/v1/incidents/{incident_id}/write-up").status_code == 404

    # A node incident ends with its node: nobody resolves it by hand (a tenant may not try).
    assert h.operator.post(f"/v1/incidents/{incident_id}:resolve").status_code == 409
    assert h.client(key).post(f"/v1/incidents/{incident_id}:resolve").status_code == 403
    assert h.operator.post("/v1/incidents/inc_nope:resolve").status_code == 404

    # The operator's root cause, with its 4xx naming the field.
    bad_body = h.operator.post(f"/v1/incidents/{incident_id}/root-cause", json={"root_cause": ""})
    assert bad_body.status_code == 422 and "root_cause" in bad_body.text
    bad_status = h.operator.get("/v1/incidents", params={"status": "sideways"})
    assert bad_status.status_code == 422 and "status" in bad_status.text
    written = h.operator.post(
        f"/v1/incidents/{incident_id}/root-cause",
        json={"root_cause": "a GPU off the bus", "follow_ups": ["watch the node for a recurrence"]},
    )
    assert written.status_code == 200, written.text
    assert written.json()["root_cause_by"].startswith("operator:")
    patched = h.operator.patch(f"/v1/incidents/{incident_id}/root-cause", json={"root_cause": "a loose riser"})
    assert patched.json()["follow_ups"] == ["watch the node for a recurrence"]
    text = h.operator.get(f"/v1/incidents/{incident_id}/write-up").text
    assert "a loose riser" in text and "- [ ] watch the node for a recurrence" in text
    assert h.operator.get("/v1/incidents/inc_nope").status_code == 404
