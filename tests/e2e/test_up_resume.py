"""`gpucloud up` stops cleanly on SIGTERM, and a second `up` on the same data dir resumes: the
allocation made before is still there and its workflow still answers a cancel."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from gpucloud.devstack.stack import free_port, port_in_use
from support.ledger_auth import auth_for, register
from support.stack import wait_until


def _up(env: dict, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gpucloud.cli.main", "up", "--nodes", "4"], env=env, stdout=log, stderr=subprocess.STDOUT
    )


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def _exited(proc: subprocess.Popen, tmp_path) -> bool:
    """Fail at once, with its log, when `up` died instead of waiting out the deadline."""
    if proc.poll() is None:
        return False
    raise AssertionError(f"`up` exited with {proc.returncode}:\n{(tmp_path / 'up.log').read_text()[-4000:]}")


@pytest.mark.long
def test_up_stops_cleanly_and_resumes(tmp_path):
    ports = {name: free_port() for name in ("api", "sim", "temporal", "ledger", "tracker", "bmc")}
    env = {
        **os.environ,
        "GPUCLOUD_DATA_DIR": str(tmp_path),
        "GPUCLOUD_API__PORT": str(ports["api"]),
        "GPUCLOUD_AGENT__SIM_PORT": str(ports["sim"]),
        "GPUCLOUD_TEMPORAL__ADDRESS": f"127.0.0.1:{ports['temporal']}",
        "GPUCLOUD_LEDGER__PORT": str(ports["ledger"]),
        "GPUCLOUD_TRACKER__URL": f"http://127.0.0.1:{ports['tracker']}",
        "GPUCLOUD_BMC__EMULATOR_PORT": str(ports["bmc"]),
    }
    api = f"http://127.0.0.1:{ports['api']}"
    log = open(tmp_path / "up.log", "ab")  # noqa: SIM115 - both runs of `up` write to it; closed with the test

    def nodes(op) -> list[dict]:
        try:
            return op.get("/v1/nodes").json()["items"]
        except (httpx.HTTPError, KeyError, ValueError):
            return []

    proc = _up(env, log)
    try:
        wait_until(lambda: (tmp_path / "operator_token").exists(), timeout_s=60, what="operator token")
        token = (tmp_path / "operator_token").read_text().strip()
        assert oct((tmp_path / "operator_token").stat().st_mode & 0o777) == "0o600"
        op = httpx.Client(base_url=api, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        wait_until(
            lambda: [n["state"] for n in nodes(op)] == ["available"] * 4 or _exited(proc, tmp_path),
            timeout_s=180,
            what="fleet up",
        )
        tenant = op.post("/v1/tenants", json={"name": "resume"}).json()
        key = tenant["api_key"]["key"]  # shown once, in the answer that creates the tenant
        wait_until(
            lambda: op.get(f"/v1/tenants/{tenant['id']}").json()["status"] == "active",
            timeout_s=60,
            what="tenant onboarded",
        )
        acme = httpx.Client(base_url=api, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        alloc_id = acme.post(
            "/v1/allocations", json={"gpu_type": "H100", "node_count": 2, "region": "us-east-1"}
        ).json()["allocation"]["id"]
        wait_until(
            lambda: acme.get(f"/v1/allocations/{alloc_id}").json()["status"] == "ready",
            timeout_s=60,
            what="allocation ready",
        )
        # `up` runs the billing ledger too (its own DB in the data dir), with a price book.
        ledger_url = f"http://127.0.0.1:{ports['ledger']}"
        register(ledger_url, tmp_path)  # the stack's ledger trusts the data dir's issuer key
        unsigned = httpx.get(f"{ledger_url}/v1/price-book/versions")
        assert unsigned.status_code == 401  # the ledger answers only the control plane's tokens
        assert httpx.get(f"{ledger_url}/v1/price-book/versions", auth=auth_for(ledger_url)).json()[0]["prices"]
        assert (tmp_path / "ledger.db").exists()
    finally:
        _stop(proc)
    for name, port in ports.items():
        assert not port_in_use("127.0.0.1", port), f"the {name} port {port} still in use after stop"

    proc = _up(env, log)
    try:
        wait_until(lambda: len(nodes(op)) == 4 or _exited(proc, tmp_path), timeout_s=180, what="second up")
        assert acme.get(f"/v1/allocations/{alloc_id}").json()["status"] == "ready"
        assert sorted(n["state"] for n in nodes(op)) == ["active", "active", "available", "available"]
        assert acme.post(f"/v1/allocations/{alloc_id}/cancel").status_code == 202
        wait_until(
            lambda: acme.get(f"/v1/allocations/{alloc_id}").json()["status"] == "released",
            timeout_s=90,
            what="released after resume",
        )
        wait_until(lambda: [n["state"] for n in nodes(op)] == ["available"] * 4, timeout_s=90, what="nodes back")
    finally:
        _stop(proc)
