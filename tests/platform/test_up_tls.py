"""`gpucloud up --tls`: a private CA in the data dir, and every server of the stack (API, ledger,
tracker, simulated fleet and fabric managers) speaking only TLS with a certificate that CA
signed. A tenant gets an allocation through it; plain HTTP and an unknown CA get nowhere. `up`
stops cleanly on SIGTERM (every port freed), and a second `up` on the same data dir resumes with
the same CA: the allocation made before is still there and its workflow still answers a cancel.
A server asked to listen off loopback without TLS refuses to start."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time

import httpx
import pytest

from gpucloud.devstack.stack import free_port, port_in_use
from gpucloud.web.service_tokens import load_or_create_issuer, public_key_path
from support.ledger_auth import auth_for, register
from support.stack import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.one_database]


def _up(env: dict, log) -> subprocess.Popen:
    command = [sys.executable, "-m", "gpucloud.cli.main", "up", "--tls", "--nodes", "4"]
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def _exited(proc: subprocess.Popen, tmp_path) -> bool:
    """Fail at once, with its log, when `up` died instead of waiting out the deadline."""
    if proc.poll() is None:
        return False
    raise AssertionError(f"`up` exited with {proc.returncode}:\n{(tmp_path / 'up.log').read_text()[-4000:]}")


@pytest.mark.long
def test_up_with_tls_serves_over_tls_stops_cleanly_and_resumes(tmp_path, cli_config):
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
    api = f"https://127.0.0.1:{ports['api']}"
    ca_file, token_file = tmp_path / "tls" / "ca.pem", tmp_path / "operator_token"
    log = open(tmp_path / "up.log", "ab")  # noqa: SIM115 - both runs of `up` write to it; closed with the test

    proc = _up(env, log)
    try:
        wait_until(
            lambda: (token_file.exists() and ca_file.exists()) or _exited(proc, tmp_path),
            timeout_s=90,
            what="operator token and CA",
        )
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        assert oct((tmp_path / "tls" / "ca.key").stat().st_mode & 0o777) == "0o600"
        trust = ssl.create_default_context(cafile=str(ca_file))
        op = httpx.Client(
            base_url=api,
            headers={"Authorization": f"Bearer {token_file.read_text().strip()}"},
            timeout=30,
            verify=trust,
        )

        def nodes() -> list[str]:
            try:
                return sorted(n["state"] for n in op.get("/v1/nodes").json()["items"])
            except (httpx.HTTPError, KeyError, ValueError):
                return []

        wait_until(
            lambda: nodes() == ["available"] * 4 or _exited(proc, tmp_path), timeout_s=180, what="fleet up over TLS"
        )
        # `up` pointed the CLI's context 'local' at its stack: a command run from anywhere, told
        # nothing but where the config file is, reaches it over TLS with the stack's CA.
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        cli_env = {"PATH": os.environ["PATH"], "GPUCLOUD_CONFIG": str(cli_config)}
        cli_env |= {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
        listed = subprocess.run(
            [sys.executable, "-m", "gpucloud.cli.main", "nodes", "-o", "json"],
            env=cli_env,
            cwd=elsewhere,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listed.returncode == 0, listed.stderr
        assert len(json.loads(listed.stdout)["nodes"]) == 4 and list(elsewhere.iterdir()) == []
        assert f"context    'local' in {cli_config}" in (tmp_path / "up.log").read_text()
        quotas = [{"gpu_type": "H100", "region": "us-east-1", "max_gpus": 32}]
        tenant = op.post("/v1/tenants", json={"name": "secure", "quotas": quotas}).json()
        wait_until(
            lambda: op.get(f"/v1/tenants/{tenant['id']}").json()["status"] == "active",
            timeout_s=60,
            what="tenant onboarded",
        )
        acme = httpx.Client(
            base_url=api, headers={"Authorization": f"Bearer {tenant['api_key']['key']}"}, timeout=30, verify=trust
        )
        alloc = acme.post("/v1/allocations", json={"gpu_type": "H100", "node_count": 2, "region": "us-east-1"})
        alloc_id = alloc.json()["allocation"]["id"]
        wait_until(
            lambda: acme.get(f"/v1/allocations/{alloc_id}").json()["status"] == "ready",
            timeout_s=90,
            what="allocation ready over TLS",
        )

        # Every server of the stack speaks TLS only, with a certificate only our CA vouches for.
        for name in ("api", "sim", "ledger", "tracker"):
            url = f"127.0.0.1:{ports[name]}/healthz"
            assert httpx.get(f"https://{url}", verify=trust, timeout=10).status_code == 200, name
            with pytest.raises(httpx.HTTPError):  # plain HTTP gets no answer
                httpx.get(f"http://{url}", timeout=10)
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                httpx.get(f"https://{url}", timeout=10)  # the public CAs do not know ours

        # `up` runs the billing ledger too (its own DB in the data dir), with a price book; it
        # answers only the control plane's tokens.
        ledger_url = f"https://127.0.0.1:{ports['ledger']}"
        register(ledger_url, tmp_path)  # the stack's ledger trusts the data dir's issuer key
        assert httpx.get(f"{ledger_url}/v1/price-book/versions", verify=trust).status_code == 401
        versions = httpx.get(f"{ledger_url}/v1/price-book/versions", auth=auth_for(ledger_url), verify=trust)
        assert versions.json()[0]["prices"]
        # The API asks the ledger with tokens its delegate key signs (it is never given the issuer key).
        assert acme.get("/v1/usage").status_code == 200
        assert (tmp_path / "ledger.db").exists()
    finally:
        _stop(proc)
    for name, port in ports.items():
        assert not port_in_use("127.0.0.1", port), f"the {name} port {port} still in use after stop"

    ca = ca_file.read_bytes()
    proc = _up(env, log)
    try:
        wait_until(lambda: len(nodes()) == 4 or _exited(proc, tmp_path), timeout_s=180, what="second up")
        assert ca_file.read_bytes() == ca  # the same CA: clients that trust it keep working
        assert acme.get(f"/v1/allocations/{alloc_id}").json()["status"] == "ready"
        assert nodes() == ["active", "active", "available", "available"]
        assert acme.post(f"/v1/allocations/{alloc_id}/cancel").status_code == 202
        wait_until(
            lambda: acme.get(f"/v1/allocations/{alloc_id}").json()["status"] == "released",
            timeout_s=90,
            what="released after resume",
        )
        wait_until(lambda: nodes() == ["available"] * 4, timeout_s=90, what="nodes back")
    finally:
        _stop(proc)
        log.close()


def test_a_server_off_loopback_without_tls_refuses_to_start(tmp_path):
    env = {**os.environ, "GPUCLOUD_DATA_DIR": str(tmp_path), "GPUCLOUD_LEDGER__HOST": "0.0.0.0"}
    public_key = public_key_path(load_or_create_issuer(tmp_path / "issuer_key.pem").key_path)  # what they trust
    refused = subprocess.run(
        [sys.executable, "-m", "gpucloud.cli.main", "ledger", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0
    assert "would listen on 0.0.0.0 without TLS" in refused.stderr + refused.stdout
    agent = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpucloud.cli.main",
            "agent",
            "--node-id",
            "n-1",
            "--host",
            "0.0.0.0",
            "--token",
            "gpa_n-1.secret",
            "--token-file",
            str(tmp_path / "credential"),
            "--control-plane-key",
            str(public_key),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert agent.returncode != 0
    assert "agent's action API would listen on 0.0.0.0 without TLS" in agent.stderr + agent.stdout


def test_a_tls_server_stops_promptly_while_a_client_holds_an_idle_connection(tmp_path):
    """asyncio gives a TLS peer 30 s to answer a close, and a client keeping a connection it does
    not read answers never: a server stopped with such a client exits within its bounded graceful
    shutdown (`tls.GRACEFUL_SHUTDOWN_S`), not after 30 s."""
    from gpucloud.config import Settings
    from gpucloud.devstack.stack import with_local_tls
    from gpucloud.web.tls import GRACEFUL_SHUTDOWN_S

    settings = with_local_tls(Settings(data_dir=tmp_path, ledger={"port": free_port()}))
    load_or_create_issuer(tmp_path / "issuer_key.pem")  # the key the ledger trusts
    env = {**os.environ, **settings.env()}
    ledger = subprocess.Popen([sys.executable, "-m", "gpucloud.cli.main", "ledger"], env=env)
    url = f"https://127.0.0.1:{settings.ledger.port}"
    client = httpx.Client(verify=ssl.create_default_context(cafile=str(settings.tls.ca_file)), timeout=5)
    try:

        def answers() -> bool:
            try:
                return client.get(f"{url}/healthz").status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(lambda: answers() or ledger.poll() is not None, timeout_s=60, what="ledger over TLS")
        assert ledger.poll() is None
        stopped_at = time.monotonic()
        ledger.send_signal(signal.SIGTERM)  # the client keeps its connection open, idle
        ledger.wait(GRACEFUL_SHUTDOWN_S + 10)
        assert time.monotonic() - stopped_at < GRACEFUL_SHUTDOWN_S + 5
    finally:
        client.close()
        if ledger.poll() is None:
            ledger.kill()
            ledger.wait()
