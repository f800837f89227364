"""Issue 14: `gpucloud sim --faults llama3 --time-scale N` fails nodes under a running control
plane: the XIDs its nodes report reach the health loop through the agents' own endpoint, and
the control plane records them (stamped by itself), with the faulty nodes' readings; the
report by category is the operator's."""

from __future__ import annotations

import pytest

from support.stack import async_wait_until

pytestmark = [pytest.mark.integration, pytest.mark.one_database]


async def test_a_faulty_simulated_fleet_reports_its_xids_to_the_control_plane(db_url, make_harness, in_process_worker):
    # 6 nodes at 3.8e-3 faults a node-day: a time scale of 3e6 gives one every few seconds.
    # Paused until the fleet is enrolled: an XID posted for a node the control plane does not
    # know yet is taken and dropped, and at this rate every node is faulty within seconds.
    sim_args = ("--faults", "llama3", "--time-scale", "3000000", "--faults-paused")
    h = make_harness(db_url, nodes=6, latency_scale=0.02, sim_args=sim_args)
    await in_process_worker(h.settings)
    h.enroll_fleet()
    h.sim.client.run_faults(True)

    def reported() -> dict | None:
        summary = h.sim.client.faults()
        return summary if summary["xids_reported"] >= 2 and summary["readings_reported"] >= 1 else None

    summary = await async_wait_until(reported, timeout_s=90, interval_s=0.5, what="XIDs and readings reported")
    assert (
        summary["injected"] >= 2 and sum(c["injected"] for c in summary["by_category"].values()) == summary["injected"]
    )
    with h.operator as op:
        histories = [op.get(f"/v1/nodes/{n['id']}/health").json()["xid_history"] for n in h.nodes()]
    assert sum(len(x) for x in histories) >= 2  # the control plane holds them, stamped by itself
    with h.operator as op:
        readings = [op.get(f"/v1/nodes/{n['id']}/health").json()["readings"] for n in h.nodes()]
    assert any(readings)  # a faulty node's counters, for the trend rules
    assert h.sim.client.http.get("/v1/faults", headers={"Authorization": "Bearer wrong"}).status_code == 401
