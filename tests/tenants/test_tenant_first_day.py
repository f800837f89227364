"""A tenant's first day, through the CLI only, as a new user runs it against `gpucloud up`.

The operator onboards a tenant with a quota; the tenant points the CLI at the API with its key
and asks who it is and what it may rent; allocates a node with a workload and an SSH key; is told
in nodes and GPUs why a bigger ask is refused, and that the fleet has no B200; reads its
workload's output; reaches the node over SSH; pushes a model and rolls it out by alias; reads its
usage and draft invoice; rotates its key (the grace period is not optional); cancels; and leaves
nothing behind in the directory it worked from. Every command runs in a process of its own with
only the shell's environment and a config file of its own, as a user's shell would, at 80
columns (forked from a server that imported the libraries once, the CLI imported anew:
`support/forked.run_cli`). On SQLite and on Postgres."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpucloud.devstack.stack import free_port
from support.databases import scratch_postgres
from support.forked import run_cli
from support.models import random_tensors, write_model
from support.stack import wait_until

pytestmark = pytest.mark.e2e

POSTGRES_URL = os.environ.get("GPUCLOUD_TEST_POSTGRES_URL")


@pytest.fixture(
    params=["sqlite", pytest.param("postgres", marks=pytest.mark.skipif(not POSTGRES_URL, reason="no Postgres"))]
)
def database(request) -> Iterator[dict[str, str]]:
    """Settings for `up`'s databases: its own SQLite files, or two scratch Postgres databases."""
    if request.param == "sqlite":
        yield {}
        return
    assert POSTGRES_URL is not None
    with scratch_postgres(POSTGRES_URL) as control, scratch_postgres(POSTGRES_URL) as ledger:
        yield {"GPUCLOUD_DATABASE__URL": control, "GPUCLOUD_LEDGER__DATABASE_URL": ledger}


class Shell:
    """A user's shell: a home, a config file, an empty working directory and an 80-column
    terminal; `run` is one `gpucloud` command in a process of its own."""

    def __init__(self, root: Path) -> None:
        self.home, self.cwd = root / "home", root / "work"
        self.home.mkdir()
        self.cwd.mkdir()
        self.env = {
            "PATH": os.environ["PATH"],
            "HOME": str(self.home),
            "GPUCLOUD_CONFIG": str(self.home / ".config" / "gpucloud" / "config.yaml"),
            "COLUMNS": "80",
            **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}),
        }

    def run(self, *args: str, expect: int = 0, timeout: float = 300) -> subprocess.CompletedProcess:
        done = run_cli(list(args), env=self.env, cwd=self.cwd, timeout=timeout)
        assert done.returncode == expect, (
            f"gpucloud {' '.join(args)} -> {done.returncode}\n{done.stdout}\n{done.stderr}"
        )
        return done

    def json(self, *args: str) -> dict | list:
        return json.loads(self.run(*args, "-o", "json").stdout)


@pytest.fixture
def stack(tmp_path, database) -> Iterator[tuple[Shell, subprocess.Popen]]:
    """`gpucloud up --nodes 4` in its own data dir, the CLI's context `local` its operator's."""
    shell = Shell(tmp_path)
    ports = {name: free_port() for name in ("api", "sim", "temporal", "ledger", "tracker", "bmc")}
    env = {
        **os.environ,
        **shell.env,
        "GPUCLOUD_DATA_DIR": str(tmp_path / "data"),
        "GPUCLOUD_API__PORT": str(ports["api"]),
        "GPUCLOUD_AGENT__SIM_PORT": str(ports["sim"]),
        "GPUCLOUD_TEMPORAL__ADDRESS": f"127.0.0.1:{ports['temporal']}",
        "GPUCLOUD_LEDGER__PORT": str(ports["ledger"]),
        "GPUCLOUD_TRACKER__URL": f"http://127.0.0.1:{ports['tracker']}",
        "GPUCLOUD_BMC__EMULATOR_PORT": str(ports["bmc"]),
        **database,
    }
    log = open(tmp_path / "up.log", "ab")  # noqa: SIM115 - `up` writes it until the end of the test
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpucloud.cli.main", "up", "--nodes", "4"],
        env=env,
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        token_file = tmp_path / "data" / "operator_token"

        def fleet_available() -> bool:
            """Asked over HTTP, not through a fresh CLI process every 2 s: each one imports for
            about 1.5 CPU-seconds, which `up`, starting on the same two cores, is waiting for.
            The test itself goes through the CLI."""
            if proc.poll() is not None:
                raise AssertionError(f"`up` exited:\n{(tmp_path / 'up.log').read_text()[-4000:]}")
            if not token_file.exists():
                return False
            try:
                listed = httpx.get(
                    f"http://127.0.0.1:{ports['api']}/v1/nodes",
                    headers={"Authorization": f"Bearer {token_file.read_text().strip()}"},
                    timeout=10,
                )
            except httpx.HTTPError:
                return False
            if listed.status_code != 200:
                return False
            return [n["state"] for n in listed.json()["items"]] == ["available"] * 4

        wait_until(fleet_available, timeout_s=240, interval_s=1, what="the fleet available under `up`")
        yield shell, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


@pytest.mark.long
@pytest.mark.timeout(900)  # a whole `up`, started and stopped, beside the rest of the suite
def test_a_tenants_first_day_through_the_cli(stack, tmp_path):
    shell, _ = stack
    # The operator: what the fleet offers, and a tenant with a quota (the type in any case).
    offered = shell.json("catalog")
    assert {(o["gpu_type"], o["region"]) for o in offered["items"]} == {("H100", "us-east-1")}, offered
    created = shell.json("tenants", "create", "acme", "--quota", "h100:us-east-1=16")
    key = created["api_key"]["key"]
    api_url = shell.json("config", "view")["api_url"]

    # The tenant: its own context, its key in a file only it reads.
    key_file = shell.home / "acme.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    shell.run("config", "set-context", "acme", "--api-url", api_url, "--token-file", str(key_file), "--use")
    me = shell.json("whoami")
    assert me["kind"] == "tenant" and me["tenant"]["name"] == "acme", me
    assert key.startswith(me["api_key"]["prefix"]) and key not in json.dumps(me)
    granted = [(q["gpu_type"], q["region"], q["max_gpus"]) for q in me["quotas"]["quotas"]]
    assert granted == [("H100", "us-east-1", 16)], me["quotas"]
    prices = shell.json("catalog")["items"]
    assert prices[0]["price_per_gpu_hour_micro"] and prices[0]["available_nodes"] == 4, prices

    # An allocation with a workload, a command and an SSH key.
    ssh_key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh_key)], check=True)
    allocation = shell.json(
        "allocations", "create", "--gpu-type", "h100", "--region", "us-east-1", "--nodes", "1",
        "--command", "echo hello from the node", "--env", "STAGE=first-day", "--ssh-key", f"{ssh_key}.pub",
    )  # fmt: skip
    alloc_id = allocation["id"]
    assert allocation["status"] == "ready", allocation

    # Asking for more than the quota: told in nodes and GPUs (exit 4); a type the fleet lacks: 2.
    over = shell.run("allocations", "create", "--gpu-type", "H100", "--region", "us-east-1", "--nodes", "2", expect=4)
    assert re.search(r"2 nodes \(16 GPUs\)", " ".join(over.stderr.split())), over.stderr
    b200 = shell.run("allocations", "create", "--gpu-type", "B200", "--region", "us-east-1", "--nodes", "1", expect=2)
    assert "no B200" in " ".join(b200.stderr.split()), b200.stderr

    # The table at 80 columns keeps the whole id; the workload's output and the events are there.
    assert alloc_id in shell.run("allocations", "list").stdout
    wait_until(
        lambda: "hello from the node" in shell.run("allocations", "logs", alloc_id).stdout,
        timeout_s=60,
        what="the workload's output",
    )
    shown = shell.json("allocations", "show", alloc_id)
    kinds = [e["kind"] for e in shown["events"]]
    assert "provisioning" in kinds and "ready" in kinds, kinds

    # The node over SSH, with the key the workload named, as `allocations ssh` says to.
    printed = shell.run("allocations", "ssh", alloc_id, "--print", "-i", str(ssh_key)).stdout.split()
    assert printed[:2] == ["ssh", "-p"], printed
    quiet = ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes"]
    logged_in = subprocess.run([*printed, *quiet, "echo", "reached"], capture_output=True, text=True, timeout=60)
    assert logged_in.returncode == 0 and logged_in.stdout.strip() == "reached", logged_in

    # A model, pushed and named by alias and by digest prefix.
    model = write_model(tmp_path / "model", random_tensors())
    pushed = shell.json("weights", "push", str(model), "--model", "first-day")
    digest = pushed["version"]["digest"]
    assert digest in shell.run("weights", "versions", "first-day").stdout  # the whole digest, at 80 columns
    assert shell.json("weights", "push", str(model), "--model", "first-day")["version"]["digest"] == digest
    shell.json("weights", "gates", "first-day")

    # Rolled out by a digest prefix (with a warning: not promoted); one rollout at a time.
    rollout = shell.run(
        "rollout", "start", f"first-day@{digest[:10]}", "--allocation", alloc_id, "--bake", "600", "--no-watch",
        "-o", "json",
    )  # fmt: skip
    assert "not" in rollout.stderr and "promoted" in rollout.stderr, rollout.stderr
    rollout_id = json.loads(rollout.stdout)["rollout_id"]
    assert rollout_id in [r["rollout_id"] for r in shell.json("rollouts", "list")]
    second = shell.run("rollout", "start", f"first-day@{digest}", "--allocation", alloc_id, "--no-watch", expect=4)
    assert rollout_id in " ".join(second.stderr.split()), second.stderr
    shell.run("rollout", "abort", rollout_id, "--reason", "first day")

    # Usage and the draft invoice, as the tenant sees them.
    shell.json("usage")
    shell.json("invoices", "draft")

    # A rotation names its grace period; without one it is bad usage and nothing changes.
    key_id = me["api_key"]["id"]
    shell.run("api-keys", "rotate", key_id, expect=2)
    assert shell.json("whoami")["api_key"]["id"] == key_id

    # Cancel: released, and the events say so.
    shell.run("allocations", "cancel", alloc_id, "--wait")
    kinds = [e["kind"] for e in shell.json("allocations", "show", alloc_id)["events"]]
    assert "released" in kinds, kinds
    refused = subprocess.run([*printed, *quiet, "hostname"], capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "Permission denied" in refused.stderr, refused

    # Nothing was written where the user stood.
    assert list(shell.cwd.iterdir()) == []
    shutil.rmtree(tmp_path / "model")
