"""docs/deploy.md followed as written, on one host, against what an operator starts with:
Postgres with two empty databases, a bare Temporal server (no namespace, no search attributes),
an S3 server with no bucket, and a fresh data dir. The shipped units run unedited, the way
systemd runs them (`support.systemd`: their ExecStart= with their Environment= and
EnvironmentFile= merged by systemd's rules), in the guide's order: install, configure, prepare,
start; then the checks the guide names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from gpucloud.devstack.stack import free_port
from gpucloud.web.tls import LocalCA
from support.s3 import CREDENTIALS
from support.systemd import ROOT, Host

POSTGRES_URL = os.environ.get("GPUCLOUD_TEST_POSTGRES_URL")
pytestmark = [
    pytest.mark.long,
    pytest.mark.skipif(not POSTGRES_URL, reason="the guide deploys on Postgres: set GPUCLOUD_TEST_POSTGRES_URL"),
]
CONTROL_PLANE = (
    "gpucloud-api",
    "gpucloud-ledger",
    "gpucloud-tracker",
    "gpucloud-worker@4",
    "gpucloud-worker@5",
    "gpucloud-evaluations",
)


@pytest.fixture
def databases() -> Iterator[tuple[str, str]]:
    from support.databases import scratch_postgres

    assert POSTGRES_URL
    with scratch_postgres(POSTGRES_URL, "deploy") as control, scratch_postgres(POSTGRES_URL, "deploy_ledger") as ledger:
        yield control, ledger


def configure(host: Host, edits: dict[str, str | None], *, example: str = "gpucloud.env") -> None:
    """docs/deploy.md "2. Configure": an example environment file, edited where the operator's
    own systems are (`None` drops a line: TLS to Temporal, which a bare dev server lacks)."""
    env_file = host.install(ROOT / "deploy" / f"{example}.example", f"/etc/gpucloud/{example}", 0o640)
    lines, seen = [], set()
    for line in env_file.read_text().splitlines():
        name = line.partition("=")[0].strip()
        if name in edits:
            seen.add(name)
            if edits[name] is not None:
                lines.append(f"{name}={edits[name]}")
        else:
            lines.append(line)
    lines += [f"{name}={value}" for name, value in edits.items() if name not in seen and value is not None]
    env_file.write_text("\n".join(lines) + "\n")


def secret(host: Host, name: str, value: str) -> None:
    path = host.path(f"/etc/gpucloud/secrets/{name}")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    path.write_text(value)
    path.chmod(0o600)


def wait_ready(url: str, ca: Path, *, what: str, proc: subprocess.Popen, log: Path, timeout_s: float = 90) -> dict:
    """`/readyz` answers 200, else the last answer and the unit's log say why not."""
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            answer = httpx.get(f"{url}/readyz", verify=str(ca), timeout=5)
            if answer.status_code == 200:
                return answer.json()
            last = answer.text
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.5)
    pytest.fail(f"{what} not ready in {timeout_s:.0f} s: {last}\n{log.read_text()[-3000:]}")


def gpucloud(*args: str, env: dict[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpucloud.cli.main", *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )


def test_a_deployment_from_the_guide_reaches_a_billed_allocation(
    tmp_path: Path, databases: tuple[str, str], bare_temporal: str, s3_endpoint: str
) -> None:
    control_db, ledger_db = databases
    host = Host(tmp_path / "host")
    logs = tmp_path / "logs"
    bucket = f"deploy-{uuid.uuid4().hex[:8]}"
    api_port, ledger_port, tracker_port = free_port(), free_port(), free_port()

    # 1. Install: the units and the example environment file, where the guide puts them.
    for unit in (ROOT / "deploy" / "systemd").glob("*.service"):
        host.install(unit, f"/etc/systemd/system/{unit.name}")
    host.path("/var/lib/gpucloud").mkdir(parents=True)

    # 2. Configure: where this host's Temporal, S3, database and ports are, and its TLS.
    ca = LocalCA(tmp_path / "operator-ca")  # the operator's own CA, off the host
    server = ca.issue("server", ["localhost", "127.0.0.1"])
    host.install(ca.cert_file, "/etc/gpucloud/tls/ca.pem")
    host.install(server.cert_file, "/etc/gpucloud/tls/server.pem")
    host.install(server.key_file, "/etc/gpucloud/tls/server-key.pem", 0o600)
    configure(
        host,
        {
            "GPUCLOUD_TEMPORAL__ADDRESS": bare_temporal,
            "GPUCLOUD_TEMPORAL__TLS": None,
            "GPUCLOUD_TEMPORAL__TLS_CA_FILE": None,
            "GPUCLOUD_TEMPORAL__TLS_CERT_FILE": None,
            "GPUCLOUD_TEMPORAL__TLS_KEY_FILE": None,
            "GPUCLOUD_OBJECT_STORE__BUCKET": bucket,
            "GPUCLOUD_OBJECT_STORE__ENDPOINT_URL": s3_endpoint,
            "GPUCLOUD_API__PORT": str(api_port),
            "GPUCLOUD_API__WORKERS": "1",
            "GPUCLOUD_LEDGER__URL": f"https://127.0.0.1:{ledger_port}",
            "GPUCLOUD_LEDGER__PORT": str(ledger_port),
            "GPUCLOUD_TRACKER__URL": f"https://localhost:{tracker_port}",
        },
    )
    secret(host, "GPUCLOUD_DATABASE__URL", control_db)
    secret(host, "GPUCLOUD_LEDGER__DATABASE_URL", ledger_db)
    secret(host, "GPUCLOUD_OBJECT_STORE__ACCESS_KEY_ID", CREDENTIALS["aws_access_key_id"])
    secret(host, "GPUCLOUD_OBJECT_STORE__SECRET_ACCESS_KEY", CREDENTIALS["aws_secret_access_key"])

    # 3. Prepare: everything the processes need, from nothing; a second run changes nothing.
    prepared = host.run("gpucloud-migrate", timeout_s=180)
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    again = host.run("gpucloud-migrate", timeout_s=180)
    assert again.returncode == 0 and "created" not in again.stdout, again.stdout + again.stderr
    # The evaluation worker's own environment: Temporal, and the payload keys prepare made.
    no_temporal_tls = {
        f"GPUCLOUD_TEMPORAL__TLS{suffix}": None for suffix in ("", "_CA_FILE", "_CERT_FILE", "_KEY_FILE")
    }
    configure(host, {"GPUCLOUD_TEMPORAL__ADDRESS": bare_temporal, **no_temporal_tls}, example="evaluations.env")
    keys = host.path("/etc/gpucloud/evaluations-secrets/GPUCLOUD_TEMPORAL__CODEC_KEYS")
    keys.parent.mkdir(parents=True)
    keys.write_bytes(host.path("/var/lib/gpucloud/temporal_codec_keys").read_bytes())

    # 4. Start: the control plane's units; each answers /readyz.
    api = f"https://127.0.0.1:{api_port}"
    node = Host(tmp_path / "node-01")  # a GPU node: its own file system
    try:
        for name in CONTROL_PLANE:
            host.start(name, log_dir=logs)
        ready = {
            "gpucloud-api": api,
            "gpucloud-ledger": f"https://127.0.0.1:{ledger_port}",
            "gpucloud-tracker": f"https://127.0.0.1:{tracker_port}",
            "gpucloud-worker@4": "https://127.0.0.1:9464",
            "gpucloud-worker@5": "https://127.0.0.1:9465",
        }
        for name, url in ready.items():
            wait_ready(url, ca.cert_file, what=name, proc=host.processes[name], log=logs / f"{name}.log")
        wait_for(
            lambda: "evaluation worker running" in (logs / "gpucloud-evaluations.log").read_text(),
            what="the evaluation worker polling its task queue",
            timeout_s=60,
            logs=logs,
        )

        # 5. Point the CLI at the deployment: its URL, the operator token, the CA.
        operator_token = host.path("/var/lib/gpucloud/operator_token").read_text().strip()
        cli = {
            "PATH": os.environ["PATH"],
            "HOME": str(tmp_path / "operator-home"),
            "COLUMNS": "200",
            "GPUCLOUD_API_URL": api,
            "GPUCLOUD_API__URL": api,
            "GPUCLOUD_API__OPERATOR_TOKEN": operator_token,
            "GPUCLOUD_TLS__CA_FILE": str(ca.cert_file),
        }

        # 6. A tenant, its first key printed before onboarding ends.
        created = gpucloud("tenants", "create", "acme", "-o", "json", env=cli)
        assert created.returncode == 0, created.stdout + created.stderr
        tenant = json.loads(created.stdout)
        key = tenant["api_key"]["key"]
        assert tenant["status"] == "active" and key.startswith("gpc_key_"), tenant

        # 7. Enrol a node, issue its agent's credential, and start its agent from its unit.
        agent_port = 8200  # the unit's (the agent's default port)
        nodes_file = tmp_path / "nodes.yaml"
        nodes_file.write_text(
            yaml.safe_dump(
                [
                    {
                        "id": "gpu-node-01",
                        "hostname": "gpu-node-01",
                        "region": "us-east-1",
                        "pod": "us-east-1-pod000",
                        "rack": "us-east-1-pod000-rack00",
                        "gpu_type": "H100",
                        "gpu_count": 8,
                        "agent_url": f"https://127.0.0.1:{agent_port}",
                    }
                ]
            )
        )
        enrolled = gpucloud("node", "enroll", str(nodes_file), env=cli)
        assert enrolled.returncode == 0 and "enrolled 1" in enrolled.stdout, enrolled.stdout + enrolled.stderr
        credential = node.path("/var/lib/gpucloud/agent-credential")
        issued = gpucloud("node", "credential", "gpu-node-01", "--out", str(credential), env=cli)
        assert issued.returncode == 0, issued.stdout + issued.stderr
        assert credential.stat().st_mode & 0o777 == 0o600
        agent_tls = ca.issue("agent", ["localhost", "127.0.0.1"])
        node.install(ca.cert_file, "/etc/gpucloud/tls/ca.pem")
        node.install(agent_tls.cert_file, "/etc/gpucloud/tls/agent.pem")
        node.install(agent_tls.key_file, "/etc/gpucloud/tls/agent-key.pem", 0o600)
        node.install(host.path("/var/lib/gpucloud/issuer_key.pub"), "/etc/gpucloud/issuer_key.pub")
        tools = stand_in_tools(tmp_path / "node-tools")
        agent_env = node.path("/etc/gpucloud/agent.env")
        agent_env.write_text(
            "\n".join(
                [
                    "GPUCLOUD_NODE_ID=gpu-node-01",
                    f"GPUCLOUD_API__URL={api}",
                    f"GPUCLOUD_LEDGER__URL=https://127.0.0.1:{ledger_port}",
                    "GPUCLOUD_DATA_DIR=/var/lib/gpucloud",
                    # This host has no GPU: NVML is simulated, and the hardware tools are
                    # stand-ins printing their documented outputs (tests/fixtures/tools).
                    "GPUCLOUD_AGENT_ALLOW_SIMULATED=true",
                    f"PATH={tools}:/usr/bin:/bin",
                    "GPUCLOUD_AGENT_METER_INTERVAL_S=2",
                ]
            )
            + "\n"
        )
        node.start("gpucloud-agent", log_dir=logs)
        wait_for(
            lambda: node_state(cli, "gpu-node-01") == "available",
            what="the node brought up (inspection, wipe, burn-in)",
            timeout_s=180,
            logs=logs,
        )

        # 8. The tenant's allocation, ready on that node; metered by its agent; billed.
        tenant_cli = {**cli, "GPUCLOUD_API_KEY": key}
        allocated = gpucloud(
            "allocations", "create", "--gpu-type", "H100", "--region", "us-east-1", "--nodes", "1", "-o", "json",
            env=tenant_cli, timeout_s=300,
        )  # fmt: skip
        assert allocated.returncode == 0, allocated.stdout + allocated.stderr
        allocation = json.loads(allocated.stdout)
        assert allocation["status"] == "ready", allocation
        time.sleep(6)  # a few of the agent's usage samples
        cancelled = gpucloud("allocations", "cancel", allocation["id"], "--wait", env=tenant_cli, timeout_s=300)
        assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr

        def billed() -> int:
            draft = gpucloud("invoices", "draft", "-o", "json", env=tenant_cli)
            return int(json.loads(draft.stdout)["total_micro"]) if draft.returncode == 0 else 0

        wait_for(lambda: billed() > 0, what="a non-zero draft invoice", timeout_s=60, logs=logs)
    finally:
        node.stop_all()
        host.stop_all()


def stand_in_tools(folder: Path) -> Path:
    """The hardware tools a node's agent runs, as stand-ins that print their recorded outputs."""
    fixtures = ROOT / "tests" / "fixtures" / "tools"
    outputs = {
        "dcgmi": "dcgmi-diag-r3-pass.json",
        "all_reduce_perf": "all_reduce_perf-8xh100.txt",
        "nvbandwidth": "nvbandwidth-h2d-8xh100.txt",
        "nvidia-smi": "nvidia-smi-gpu-reset-ok.txt",
    }
    folder.mkdir(parents=True)
    for tool, fixture in outputs.items():
        script = folder / tool
        script.write_text(f"#!/bin/sh\ncat '{fixtures / fixture}'\n")
        script.chmod(0o755)
    return folder


def node_state(cli: dict[str, str], node_id: str) -> str | None:
    shown = gpucloud("nodes", "-o", "json", env=cli)
    if shown.returncode != 0:
        return None
    return next((n["state"] for n in json.loads(shown.stdout)["nodes"] if n["id"] == node_id), None)


def wait_for(check, *, what: str, timeout_s: float, logs: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(1.0)
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-1500:]}" for log in sorted(logs.glob("*.log")))
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tails}")
