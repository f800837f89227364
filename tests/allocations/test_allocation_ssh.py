"""Issue 40: a tenant reaches its nodes. Each node of a ready allocation shows where it takes SSH
(its address on the tenants' network and its port, the image's login user); the keys the
workload named open it, with OpenSSH's own client, directly and through `gpucloud allocations
ssh`; after the cancel the node shows no endpoint and the same key is refused."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpucloud.cli.main import app

pytestmark = [
    pytest.mark.integration,
    pytest.mark.one_database,
    pytest.mark.skipif(shutil.which("ssh") is None or shutil.which("ssh-keygen") is None, reason="no OpenSSH client"),
]

# The test's own known_hosts: each simulated node has a host key of its own, made at its start.
NO_HOST_CHECK = ("StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "BatchMode=yes", "LogLevel=ERROR")


def _keypair(tmp_path: Path) -> tuple[Path, str]:
    key = tmp_path / "tenant_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tenant@laptop", "-f", str(key)], check=True)
    return key, key.with_suffix(".pub").read_text().strip()


def _ssh(argv: list[str], *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)


async def test_the_workloads_keys_open_its_nodes_until_the_cancel(ready_fleet, tmp_path):
    h = await ready_fleet(nodes=2, latency_scale=0.02, sim_args=("--ssh",))
    key, public = _keypair(tmp_path)
    hostnames = {n["id"]: n["hostname"] for n in h.sim.inventory()}
    ports = {n["id"]: n["ssh_port"] for n in h.sim.inventory()}
    _, tenant_key = await h.onboard()
    alloc_id = h.allocate(tenant_key, node_count=2, workload={"command": ["sleep", "infinity"], "ssh_keys": [public]})
    ready = await h.wait_allocation(tenant_key, alloc_id, "ready")

    with h.client(tenant_key) as tenant:
        nodes = tenant.get(f"/v1/allocations/{alloc_id}/nodes").json()["items"]
    assert sorted(n["node_id"] for n in nodes) == sorted(ready["node_ids"])
    for n in nodes:
        port = ports[n["node_id"]]
        assert n["ssh"] == {
            "host": "127.0.0.1",
            "port": port,
            "user": "ubuntu",
            "command": f"ssh -p {port} ubuntu@127.0.0.1",
        }, n

    env = {
        "GPUCLOUD_API__PORT": str(h.settings.api.port),
        "GPUCLOUD_DATA_DIR": str(h.settings.data_dir),
        "GPUCLOUD_API_KEY": tenant_key,
        "COLUMNS": "250",
    }

    async def cli(*args: str, code: int = 0) -> str:
        result = await asyncio.to_thread(CliRunner().invoke, app, list(args), env=env)
        assert result.exit_code == code, result.output
        return result.output

    first, second = nodes[0], nodes[1]
    assert (await cli("allocations", "ssh", alloc_id, "--print")).strip() == first["ssh"]["command"]
    printed = await cli("allocations", "ssh", alloc_id, "--node", second["node_id"], "-i", str(key), "--print")
    assert printed.strip() == f"ssh -p {ports[second['node_id']]} -i {key} ubuntu@127.0.0.1"
    assert first["ssh"]["command"] in await cli("allocations", "show", alloc_id)
    shown = json.loads(await cli("allocations", "show", alloc_id, "-o", "json"))
    assert {n["node_id"]: n["ssh"]["port"] for n in shown["nodes"]} == {n: ports[n] for n in ready["node_ids"]}
    await cli("allocations", "ssh", alloc_id, "--node", "sim-nope", "--print", code=3)

    # OpenSSH's client, with the tenant's key, runs a command on each node and sees its answer.
    options = [arg for option in NO_HOST_CHECK for arg in ("-o", option)]
    for n in nodes:
        done = await asyncio.to_thread(
            _ssh, ["ssh", *options, "-i", str(key), "-p", str(ports[n["node_id"]]), "ubuntu@127.0.0.1", "hostname"]
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == hostnames[n["node_id"]]
    # `gpucloud allocations ssh` runs that client in its own place (exec), the command after `--`.
    ssh_options = [arg for option in NO_HOST_CHECK for arg in ("--ssh-option", option)]
    run_cli = [sys.executable, "-c", "from gpucloud.cli.main import app; app()", "allocations", "ssh", alloc_id]
    done = await asyncio.to_thread(
        _ssh,
        [*run_cli, "--node", second["node_id"], "-i", str(key), *ssh_options, "--", "nvidia-smi", "-L"],
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith("GPU 0: NVIDIA H100") and len(done.stdout.splitlines()) == 8

    with h.client(tenant_key) as tenant:
        assert tenant.post(f"/v1/allocations/{alloc_id}/cancel").status_code == 202
    await h.wait_allocation(tenant_key, alloc_id, "released")
    with h.client(tenant_key) as tenant:
        after = tenant.get(f"/v1/allocations/{alloc_id}/nodes").json()["items"]
    assert all(n["ssh"] is None for n in after), after
    out = await cli("allocations", "ssh", alloc_id, "--print", code=4)
    assert "takes SSH now" in out
    for node_id, port in ports.items():  # the key opens neither node any more
        refused = await asyncio.to_thread(
            _ssh, ["ssh", *options, "-i", str(key), "-p", str(port), "ubuntu@127.0.0.1", "hostname"]
        )
        assert refused.returncode == 255 and "Permission denied" in refused.stderr, (node_id, refused.stderr)
