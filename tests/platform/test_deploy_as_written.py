"""docs/deploy.md followed as written, on one host, against what an operator starts with:
Postgres with two empty databases, a bare Temporal server (no namespace, no search attributes),
an S3 server with no bucket, and a fresh data dir. The shipped units run unedited, the way
systemd runs them (`support.systemd`: their ExecStart= with their Environment= and
EnvironmentFile= merged by systemd's rules), in the guide's order: install, configure, prepare,
start; then the checks the guide names."""

from __future__ import annotations

import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpucloud.devstack.stack import free_port
from gpucloud.web.tls import LocalCA
from support.forked import run_cli
from support.guide import steps
from support.s3 import CREDENTIALS
from support.systemd import ROOT, Host

POSTGRES_URL = os.environ.get("GPUCLOUD_TEST_POSTGRES_URL")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.long,
    pytest.mark.skipif(not POSTGRES_URL, reason="the guide deploys on Postgres: set GPUCLOUD_TEST_POSTGRES_URL"),
]
GUIDE = ROOT / "docs" / "deploy.md"


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


def gpucloud(
    command: list[str], *, env: dict[str, str], cwd: Path, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """A `gpucloud ...` line of the guide, run as the operator would, from `cwd`: in a process of
    its own with only `env` (forked from the test process's server that imported the libraries,
    `support.forked.run_cli`)."""
    assert command[0] == "gpucloud", command
    return run_cli(command[1:], env=env, cwd=cwd, timeout=timeout_s)


def test_a_deployment_from_the_guide_reaches_a_billed_allocation(
    tmp_path: Path, databases: tuple[str, str], bare_temporal: str, s3_endpoint: str
) -> None:
    guide = steps(GUIDE)
    control_db, ledger_db = databases
    host = Host(tmp_path / "host")  # the control plane's host
    node = Host(tmp_path / "node-01")  # a GPU node: its own file system
    workstation = tmp_path / "workstation"  # where the operator runs the CLI
    home = workstation / "home"
    home.mkdir(parents=True)
    logs = tmp_path / "logs"
    bucket = f"deploy-{uuid.uuid4().hex[:8]}"
    api_port, ledger_port, tracker_port = free_port(), free_port(), free_port()
    api, ledger = f"https://127.0.0.1:{api_port}", f"https://127.0.0.1:{ledger_port}"
    agent_port = 8200  # the agent unit's (the agent's default port)
    # The guide's example hosts, and where they are here.
    where = {
        "https://api.internal:8000": api,
        "https://ledger.internal:8700": ledger,
        "https://gpu-node-01.internal:8200": f"https://127.0.0.1:{agent_port}",
        "~/": f"{home}/",
    }

    # 1. Install: the units and the example environment files, where the guide puts them.
    for unit in (ROOT / "deploy" / "systemd").glob("*.service"):
        host.install(unit, f"/etc/systemd/system/{unit.name}")
    host.path("/var/lib/gpucloud").mkdir(parents=True)

    # 2. Configure: where this host's Temporal, S3, database and ports are, and its TLS.
    ca = LocalCA(tmp_path / "operator-ca")  # the operator's own CA, off the host
    server = ca.issue("server", ["localhost", "127.0.0.1"])
    host.install(ca.cert_file, "/etc/gpucloud/tls/ca.pem")
    host.install(server.cert_file, "/etc/gpucloud/tls/server.pem")
    host.install(server.key_file, "/etc/gpucloud/tls/server-key.pem", 0o600)
    no_temporal_tls = {
        f"GPUCLOUD_TEMPORAL__TLS{suffix}": None for suffix in ("", "_CA_FILE", "_CERT_FILE", "_KEY_FILE")
    }
    configure(
        host,
        {
            "GPUCLOUD_TEMPORAL__ADDRESS": bare_temporal,
            **no_temporal_tls,  # the bare dev server speaks plain gRPC on loopback
            "GPUCLOUD_OBJECT_STORE__BUCKET": bucket,
            "GPUCLOUD_OBJECT_STORE__ENDPOINT_URL": s3_endpoint,
            "GPUCLOUD_FABRIC__URL": None,  # no fabric managers on this host: the worker must say so
            "GPUCLOUD_API__PORT": str(api_port),
            "GPUCLOUD_API__URL": api,
            "GPUCLOUD_API__WORKERS": "1",
            "GPUCLOUD_LEDGER__URL": ledger,
            "GPUCLOUD_LEDGER__PORT": str(ledger_port),
            "GPUCLOUD_TRACKER__URL": f"https://localhost:{tracker_port}",
        },
    )
    secret(host, "GPUCLOUD_DATABASE__URL", control_db)
    secret(host, "GPUCLOUD_LEDGER__DATABASE_URL", ledger_db)
    secret(host, "GPUCLOUD_OBJECT_STORE__ACCESS_KEY_ID", CREDENTIALS["aws_access_key_id"])
    secret(host, "GPUCLOUD_OBJECT_STORE__SECRET_ACCESS_KEY", CREDENTIALS["aws_secret_access_key"])
    configure(host, {"GPUCLOUD_TEMPORAL__ADDRESS": bare_temporal, **no_temporal_tls}, example="evaluations.env")

    # 3. Prepare, as the guide says; a second run changes nothing.
    [start_prepare] = [c for c in guide["prepare"].commands() if c[0] == "systemctl"]
    first = host.systemctl(start_prepare, log_dir=logs)["gpucloud-migrate"]
    assert "created" in first, first
    again = host.systemctl(start_prepare, log_dir=logs)["gpucloud-migrate"]
    assert "created" not in again and "refused" not in again, again
    # The evaluation worker's one secret, copied as the guide says.
    keys = host.path("/etc/gpucloud/evaluations-secrets/GPUCLOUD_TEMPORAL__CODEC_KEYS")
    keys.parent.mkdir(parents=True)
    keys.write_bytes(host.path("/var/lib/gpucloud/temporal_codec_keys").read_bytes())

    try:
        # 4. Start: the guide's units; each answers /readyz.
        for command in guide["start"].commands():
            host.systemctl(command, log_dir=logs)
        ready = {
            "gpucloud-api": api,
            "gpucloud-ledger": ledger,
            "gpucloud-tracker": f"https://127.0.0.1:{tracker_port}",
            "gpucloud-worker@4": "https://127.0.0.1:9464",  # each instance's own port, 946N
            "gpucloud-worker@5": "https://127.0.0.1:9465",
        }
        assert set(host.processes) >= {*ready, "gpucloud-evaluations"}, sorted(host.processes)
        for name, url in ready.items():
            wait_ready(url, ca.cert_file, what=name, proc=host.processes[name], log=logs / f"{name}.log")
        worker_log = (logs / "gpucloud-worker@4.log").read_text()
        assert "no fabric managers (GPUCLOUD_FABRIC__URL)" in worker_log, worker_log[-2000:]
        wait_for(
            lambda: "evaluation worker running" in (logs / "gpucloud-evaluations.log").read_text(),
            what="the evaluation worker polling its task queue",
            timeout_s=60,
            logs=logs,
        )

        # 5. Point the CLI: the operator token and the CA copied to the workstation, a context.
        (home / ".gpucloud").mkdir(mode=0o700)
        token_copy = home / ".gpucloud" / "prod-operator-token"
        token_copy.write_bytes(host.path("/var/lib/gpucloud/operator_token").read_bytes())
        token_copy.chmod(0o600)
        (home / ".gpucloud" / "prod-ca.pem").write_bytes(ca.cert_file.read_bytes())
        cli = {"PATH": os.environ["PATH"], "HOME": str(home), "COLUMNS": "200"}
        for command in guide["point-cli"].commands(where):
            done = gpucloud(command, env=cli, cwd=workstation)
            assert done.returncode == 0, done.stdout + done.stderr
        assert "prod" in done.stdout and api in done.stdout, done.stdout

        # 6. A tenant; its first key printed before onboarding ends.
        [create_tenant] = guide["tenant"].commands(where)
        created = gpucloud(create_tenant, env=cli, cwd=workstation)
        assert created.returncode == 0, created.stdout + created.stderr
        key = re.search(r"first API key \(shown once\): (gpc_key_\S+)", created.stdout)
        assert key and "active" in created.stdout, created.stdout

        # 7. The node: described, enrolled, its credential issued, then its agent from its unit.
        (workstation / "nodes.yaml").write_text(guide["nodes-file"].substituted(where))
        for command in guide["enroll"].commands(where):
            done = gpucloud(command, env=cli, cwd=workstation)
            assert done.returncode == 0, done.stdout + done.stderr
        credential = node.install(workstation / "gpu-node-01.credential", "/var/lib/gpucloud/agent-credential", 0o600)
        assert credential.read_text().startswith("gpa_gpu-node-01.")
        agent_tls = ca.issue("agent", ["localhost", "127.0.0.1"])
        node.install(ca.cert_file, "/etc/gpucloud/tls/ca.pem")
        node.install(agent_tls.cert_file, "/etc/gpucloud/tls/agent.pem")
        node.install(agent_tls.key_file, "/etc/gpucloud/tls/agent-key.pem", 0o600)
        node.install(host.path("/var/lib/gpucloud/issuer_key.pub"), "/etc/gpucloud/issuer_key.pub")
        tools = stand_in_tools(tmp_path / "node-tools")
        node.path("/etc/gpucloud/agent.env").write_text(
            guide["agent-env"].substituted(where)
            # This host has no GPU: NVML is simulated, and the hardware tools are stand-ins
            # printing their documented outputs (tests/fixtures/tools); usage every 2 s.
            + "\nGPUCLOUD_AGENT_ALLOW_SIMULATED=true\nGPUCLOUD_AGENT_METER_INTERVAL_S=2\n"
            + f"PATH={tools}:/usr/bin:/bin\n"
        )
        for command in guide["agent"].commands():
            node.systemctl(command, log_dir=logs)
        operator = api_reader(api, token_copy.read_text().strip(), ca.cert_file)
        wait_for(
            lambda: operator("/v1/nodes/gpu-node-01").get("state") == "available",
            what="the node brought up (inspection, wipe, burn-in)",
            timeout_s=180,
            logs=logs,
        )

        # 8. Verify, as the tenant: the node listed, an allocation ready on it, a bill.
        tenant_cli = {**cli, "GPUCLOUD_API_KEY": key.group(1)}
        listed, allocate, draft = guide["verify"].commands(where)
        shown = gpucloud(listed, env=cli, cwd=workstation)
        assert shown.returncode == 0 and "gpu-node-01" in shown.stdout, shown.stdout + shown.stderr
        allocated = gpucloud(allocate, env=tenant_cli, cwd=workstation, timeout_s=300)
        assert allocated.returncode == 0 and "ready" in allocated.stdout, allocated.stdout + allocated.stderr

        tenant = api_reader(api, key.group(1), ca.cert_file)
        wait_for(
            lambda: tenant("/v1/invoices:draft").get("total_micro", 0) > 0,
            what="a non-zero draft invoice",
            timeout_s=90,
            logs=logs,
        )
        drafted = gpucloud(draft, env=tenant_cli, cwd=workstation)
        total = re.search(r"^total (\d+\.\d+)", drafted.stdout, re.MULTILINE)
        assert drafted.returncode == 0 and total and float(total.group(1)) > 0, drafted.stdout + drafted.stderr
        # The metrics line, as the guide's shell runs it on the control-plane host.
        [metrics] = guide["metrics"].substituted(where).splitlines()
        counted = subprocess.run(["bash", "-c", host.mapped(metrics)], capture_output=True, text=True, timeout=30)
        count = counted.stdout.split()
        assert counted.returncode == 0 and count and float(count[-1]) >= 1, counted.stdout + counted.stderr
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


def api_reader(url: str, token: str, ca: Path):
    """GET a path of the API as the token's holder: the document, or {} on any failure (the waits
    poll the API itself; each of the guide's own lines runs once, through the CLI)."""

    def get(path: str) -> dict:
        try:
            answer = httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {token}"}, verify=str(ca), timeout=10)
        except httpx.HTTPError:
            return {}
        return answer.json() if answer.status_code == 200 else {}

    return get


def wait_for(check, *, what: str, timeout_s: float, logs: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(1.0)
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-1500:]}" for log in sorted(logs.glob("*.log")))
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tails}")
