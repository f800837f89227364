"""Issue 14: an allocation may carry a workload (a command, its environment, the tenant's SSH
keys); every node's provision starts it through its agent, and the release stops it."""

from __future__ import annotations

import pytest

from gpucloud.models.workflow_ids import allocation_workflow_id

pytestmark = [pytest.mark.integration, pytest.mark.one_database]


SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpucloudtenantkeynotinclear tenant@laptop"
WORKLOAD = {
    "command": ["torchrun", "--nproc-per-node", "8", "train.py"],
    "env": {"EPOCHS": "3", "HF_TOKEN": "hf_tenant_secret_never_in_clear"},
    "ssh_keys": [SSH_KEY],
}


async def test_each_node_of_the_allocation_runs_its_workload_until_release(ready_fleet, temporal_env):
    h = await ready_fleet(nodes=2, latency_scale=0.02)
    _, key = await h.onboard()
    with h.client(key) as tenant:
        body = {"gpu_type": "H100", "node_count": 2, "region": "us-east-1", "workload": WORKLOAD}
        created = tenant.post("/v1/allocations", json=body)
        assert created.status_code == 202, created.text
        alloc = created.json()["allocation"]
        assert alloc["workload"]["command"] == WORKLOAD["command"]
        ready = await h.wait_allocation(key, alloc["id"], "ready")
        for node_id in ready["node_ids"]:
            assert h.sim.node(node_id)["workload"] == WORKLOAD["command"]
        # What the agents report of it shows in the allocation's nodes, for its tenant.
        h.push_heartbeats()
        nodes = tenant.get(f"/v1/allocations/{alloc['id']}/nodes").json()["items"]
        assert sorted(n["node_id"] for n in nodes) == sorted(ready["node_ids"])
        assert all(n["state"] == "active" and n["workload"]["state"] == "running" for n in nodes), nodes
        bad = tenant.post("/v1/allocations", json={**body, "workload": {"command": []}})
        assert bad.status_code == 422 and "a command, an image, or both" in bad.text
        assert tenant.post(f"/v1/allocations/{alloc['id']}/cancel").status_code == 202
        await h.wait_allocation(key, alloc["id"], "released")
    for node_id in ready["node_ids"]:
        assert h.sim.node(node_id)["workload"] is None
    # What Temporal keeps (read raw from the server, as its database and Web UI hold it) carries
    # the workload sealed: neither its environment nor its SSH keys in clear.
    workflow_ids = [allocation_workflow_id(alloc["id"]), *(f"node-{n}" for n in ready["node_ids"])]
    for workflow_id in workflow_ids:
        history = await temporal_env.client.get_workflow_handle(workflow_id).fetch_history()
        raw = b"".join(event.SerializeToString() for event in history.events)
        assert b"binary/encrypted" in raw
        for secret in (b"hf_tenant_secret_never_in_clear", b"gpucloudtenantkeynotinclear"):
            assert secret not in raw, workflow_id
    _, other = await h.onboard()
    with h.client(other) as stranger:
        assert stranger.get(f"/v1/allocations/{alloc['id']}/nodes").status_code == 404
