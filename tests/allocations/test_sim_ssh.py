"""Issue 40: each simulated node takes SSH on a loopback port of its own (asyncssh), letting in
exactly the keys the action core installed for the current allocation, as the image's login
user only, with a restricted shell that executes nothing and no forwarding."""

from __future__ import annotations

import asyncio

import asyncssh
import pytest

from gpucloud.agent.action_core import ActionCore
from gpucloud.protocol.actions import ActionRequest, Workload
from gpucloud.sim.nodes import MAX_SSH_NODES, Fleet, FleetSpec, SimulatedHardware
from gpucloud.sim.ssh import NOT_FOUND, RestrictedShell

pytestmark = pytest.mark.unit

USER = "ubuntu"


def _key() -> asyncssh.SSHKey:
    return asyncssh.generate_private_key("ssh-ed25519", comment="tenant@laptop")


def _public(key: asyncssh.SSHKey) -> str:
    return key.export_public_key().decode().strip()


async def _connect(fleet: Fleet, node_id: str, key: asyncssh.SSHKey, *, user: str = USER):
    assert fleet.ssh is not None
    port = fleet.ssh.port(node_id)
    return await asyncssh.connect(
        "127.0.0.1", port, username=user, client_keys=[key], known_hosts=None, agent_path=None, password=None
    )


async def _act(fleet: Fleet, node_id: str, action: str, request_id: str, **fields) -> tuple[int, dict]:
    node = fleet.nodes[node_id]
    core = ActionCore(node, SimulatedHardware(fleet, node))
    return await core.act(action, ActionRequest(request_id=request_id, **fields))


@pytest.fixture
async def fleet():
    fleet = Fleet(FleetSpec(nodes=2, latency_scale=0, ssh=True, ssh_user=USER))
    await fleet.start_ssh()
    yield fleet
    assert fleet.ssh is not None
    await fleet.ssh.close()


async def test_a_node_lets_in_its_allocations_keys_from_provision_to_release(fleet):
    node_id, other_id = list(fleet.nodes)
    tenant, stranger = _key(), _key()
    inventory = {n["id"]: n for n in fleet.inventory("http://sim")}
    assert inventory[node_id]["ssh_host"] == "127.0.0.1"
    assert inventory[node_id]["ssh_port"] != inventory[other_id]["ssh_port"]  # a port a node

    with pytest.raises(asyncssh.PermissionDenied):  # no allocation: no key opens it
        await _connect(fleet, node_id, tenant)
    workload = Workload(command=["sleep", "infinity"], ssh_keys=[_public(tenant)])
    status, body = await _act(fleet, node_id, "provision", "p1", tenant_id="t1", allocation_id="a1", workload=workload)
    assert status == 200, body

    async with await _connect(fleet, node_id, tenant) as conn:
        done = await conn.run("hostname && nvidia-smi -L; whoami", timeout=10)
        assert done.exit_status == 0
        lines = str(done.stdout).splitlines()
        assert lines[0] == fleet.nodes[node_id].hostname
        assert lines[1].startswith("GPU 0: NVIDIA H100") and len(lines) == 8 + 2 and lines[-1] == USER
        with pytest.raises(asyncssh.ChannelOpenError):  # no forwarding into the fleet's process
            await conn.open_connection("127.0.0.1", 22)
    for intruder, user in ((stranger, USER), (tenant, "root")):
        with pytest.raises(asyncssh.PermissionDenied):
            await _connect(fleet, node_id, intruder, user=user)
    with pytest.raises(asyncssh.PermissionDenied):  # the other node holds no key of the tenant
        await _connect(fleet, other_id, tenant)

    # A session open at the release ends with it, and the key opens nothing after.
    session = await _connect(fleet, node_id, tenant)
    assert (await _act(fleet, node_id, "release", "r1"))[0] == 200
    await asyncio.wait_for(session.wait_closed(), timeout=10)
    with pytest.raises(asyncssh.PermissionDenied):
        await _connect(fleet, node_id, tenant)


async def test_a_wipe_takes_the_keys_out_too(fleet):
    node_id = next(iter(fleet.nodes))
    tenant = _key()
    workload = Workload(command=["true"], ssh_keys=[_public(tenant)])
    await _act(fleet, node_id, "provision", "p1", tenant_id="t1", allocation_id="a1", workload=workload)
    fleet.nodes[node_id].workload_running = False  # released behind the core's back: the wipe still cleans
    assert (await _act(fleet, node_id, "wipe", "w1"))[0] == 200
    assert fleet.nodes[node_id].ssh_keys == ()
    with pytest.raises(asyncssh.PermissionDenied):
        await _connect(fleet, node_id, tenant)


async def test_a_login_without_a_command_gets_a_prompt_until_exit(fleet):
    node_id = next(iter(fleet.nodes))
    tenant = _key()
    workload = Workload(command=["true"], ssh_keys=[_public(tenant)])
    await _act(fleet, node_id, "provision", "p1", tenant_id="t1", allocation_id="a1", workload=workload)
    async with await _connect(fleet, node_id, tenant) as conn:
        process = await conn.create_process()
        process.stdin.write("hostname\nrm -rf /\nexit\n")
        done = await asyncio.wait_for(process.wait(), timeout=10)
    hostname = fleet.nodes[node_id].hostname
    assert str(done.stdout).startswith(f"$ {hostname}\n$ sim-shell: rm: command not found")
    assert done.exit_status == NOT_FOUND  # the last command's status, as a shell exits


def test_the_restricted_shell_answers_its_commands_and_runs_nothing_else():
    node = Fleet(FleetSpec(nodes=1)).nodes["sim-00000"]
    shell = RestrictedShell(node, user=USER)
    assert shell.run("echo 'hello  world'") == ("hello  world\n", 0)
    assert shell.run("false && hostname; echo after") == ("after\n", 0)
    out, status = shell.run("python3 -c 'import os'")
    assert status == NOT_FOUND and "command not found" in out
    for line in ("cat /etc/passwd | head", "echo x > /tmp/f", "hostname & hostname"):
        out, status = shell.run(line)
        assert status == 2 and "not supported" in out, line
    assert shell.run("echo 'unbalanced")[1] == 2


def test_a_fleet_too_large_for_a_listener_a_node_is_refused():
    with pytest.raises(ValueError, match="at most"):
        FleetSpec(nodes=MAX_SSH_NODES + 1, ssh=True)
