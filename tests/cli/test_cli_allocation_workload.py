"""Issue 40: `gpucloud allocations create --command/--image/--env/--ssh-key` builds the workload
each node runs, and `gpucloud allocations logs` prints what it wrote. Before: create had no
workload options (curl only) and there was no logs command."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from gpucloud.cli import resources as cli
from gpucloud.cli.main import app
from gpucloud.models.tables import AllocationPublic

pytestmark = pytest.mark.unit

PUBLIC_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpucloudtenant tenant@laptop"


def _allocation(**fields) -> AllocationPublic:
    now = "2026-01-01T00:00:00Z"
    base = {
        "id": "alloc_1",
        "tenant_id": "t1",
        "status": "ready",
        "gpu_type": "H100",
        "region": "us-east-1",
        "node_count": 2,
        "node_ids": ["sim-00000", "sim-00001"],
        "desired": "running",
        "failure_reason": None,
        "fabric_domain": "us-east-1-pod000",
        "nvlink_domain": None,
        "created_at": now,
        "updated_at": now,
    }
    return AllocationPublic.model_validate(base | fields)


class FakeAllocations:
    def __init__(self) -> None:
        self.created: list[dict] = []
        self.read: list[tuple] = []

    def create(self, gpu_type, region, node_count=None, **options):
        self.created.append({"gpu_type": gpu_type, "region": region, "node_count": node_count, **options})
        return SimpleNamespace(allocation=_allocation())

    def get(self, allocation_id):
        return _allocation(id=allocation_id)

    def logs(self, allocation_id, node_id, *, tail=None, follow=False):
        self.read.append((allocation_id, node_id, tail, follow))
        yield "epoch 1\n"
        yield "\x1b]0;owned\x07done\n"


class FakeApi:
    def __init__(self) -> None:
        self.allocations = FakeAllocations()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def _fake(monkeypatch) -> FakeApi:
    api = FakeApi()
    monkeypatch.setattr(cli, "api_client", lambda *args, **kwargs: api)
    return api


def test_create_builds_the_workload_from_its_options(monkeypatch, tmp_path) -> None:
    api = _fake(monkeypatch)
    key = tmp_path / "id_ed25519.pub"
    key.write_text(PUBLIC_KEY + "\n")
    other = tmp_path / "other.pub"
    other.write_text("ssh-rsa AAAAB3NzaC1yc2E other@host\n")
    args = ["allocations", "create", "--gpu-type", "H100", "--region", "us-east-1", "--nodes", "2", "--no-wait"]
    workload = [
        "--command",
        "torchrun --nproc-per-node 8 'train script.py'",
        "--image",
        "nvcr.io/nvidia/pytorch:24.05-py3",
        "--env",
        "EPOCHS=3",
        "--env",
        "ARGS=a=b",
        "--ssh-key",
        str(key),
        "--ssh-key",
        str(other),
    ]
    result = CliRunner().invoke(app, [*args, *workload, "-o", "json"])
    assert result.exit_code == 0, result.output
    (created,) = api.allocations.created
    sent = created["workload"].model_dump(mode="json")
    assert sent["command"] == ["torchrun", "--nproc-per-node", "8", "train script.py"]
    assert sent["image"] == "nvcr.io/nvidia/pytorch:24.05-py3"
    assert sent["env"] == {"EPOCHS": "3", "ARGS": "a=b"}
    assert sent["ssh_keys"] == [PUBLIC_KEY, "ssh-rsa AAAAB3NzaC1yc2E other@host"]
    assert json.loads(result.output)["id"] == "alloc_1"
    # Without workload options, no workload is sent.
    assert CliRunner().invoke(app, args).exit_code == 0
    assert api.allocations.created[1]["workload"] is None


def test_bad_workload_options_are_usage_errors_that_name_the_option(monkeypatch, tmp_path) -> None:
    api = _fake(monkeypatch)
    args = ["allocations", "create", "--gpu-type", "H100", "--region", "us-east-1", "--no-wait"]
    private = tmp_path / "id_ed25519"
    private.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nb3Blbn\n-----END OPENSSH PRIVATE KEY-----\n")
    cases = {
        ("--command", "python t.py", "--env", "EPOCHS"): ("--env", "'EPOCHS' is not NAME=VALUE"),
        ("--command", "python t.py", "--env", "=3"): ("--env", "NAME=VALUE"),
        ("--command", "python t.py", "--ssh-key", str(private)): ("--ssh-key", "private key"),
        ("--command", "python t.py", "--ssh-key", str(tmp_path / "missing.pub")): ("--ssh-key", "cannot read"),
        ("--env", "A=1"): ("--command/--image", "a command, an image, or both"),
        ("--command", "python 'unclosed"): ("--command", "No closing quotation"),
    }
    for options, (option, message) in cases.items():
        result = CliRunner().invoke(app, [*args, *options])
        assert result.exit_code == 2, (options, result.output)
        flat = " ".join(result.output.split()).replace("│", "").replace("  ", " ")
        assert option in flat and message in " ".join(flat.split()), (options, result.output)
    assert api.allocations.created == []  # nothing was sent


def test_logs_prints_the_workload_s_output_of_the_node_asked_or_the_first(monkeypatch) -> None:
    api = _fake(monkeypatch)
    result = CliRunner().invoke(app, ["allocations", "logs", "alloc_1", "--tail", "5", "--follow"])
    assert result.exit_code == 0, result.output
    assert "epoch 1\n" in result.output and "done\n" in result.output
    assert api.allocations.read == [("alloc_1", "sim-00000", 5, True)]
    result = CliRunner().invoke(app, ["allocations", "logs", "alloc_1", "--node", "sim-00001"])
    assert result.exit_code == 0 and api.allocations.read[-1] == ("alloc_1", "sim-00001", None, False)
    assert CliRunner().invoke(app, ["allocations", "logs", "alloc_1", "--tail", "-1"]).exit_code == 2
    as_json = CliRunner().invoke(app, ["allocations", "logs", "alloc_1", "-o", "json"])
    assert as_json.exit_code == 0, as_json.output
    pieces = [json.loads(line) for line in as_json.output.splitlines() if line.startswith("{")]
    assert pieces[0] == {"node_id": "sim-00000", "text": "epoch 1\n"} and len(pieces) == 2


def test_a_workload_s_control_characters_are_shown_not_obeyed_on_a_terminal() -> None:
    assert cli.shown_on_terminal("\x1b]0;owned\x07done\tok\n") == "^[]0;owned^Gdone\tok\n"


def test_queue_tier_and_durations_are_sent_as_the_api_names_them(monkeypatch) -> None:
    api = _fake(monkeypatch)
    args = ["allocations", "create", "--gpu-type", "H100", "--region", "us-east-1", "--nodes", "8", "--no-wait"]
    options = ["--queue", "--max-wait", "2h", "--expected-duration", "90m", "--tier", "preemptible"]
    result = CliRunner().invoke(app, [*args, *options])
    assert result.exit_code == 0, result.output
    (sent,) = api.allocations.created
    assert (sent["queue"], sent["max_wait_s"], sent["expected_duration_s"], sent["tier"]) == (
        True,
        7200,
        5400,
        "preemptible",
    )
    # --max-wait without --queue, and a tier the API has not, are usage errors; nothing is sent.
    assert CliRunner().invoke(app, [*args, "--max-wait", "2h"]).exit_code == 2
    assert CliRunner().invoke(app, [*args, "--tier", "spot"]).exit_code == 2
    assert len(api.allocations.created) == 1
