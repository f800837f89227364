"""A wipe cleans the hardware before the node goes back to the pool: every GPU reset, each tenant
disk erased by the drive (NVMe: crypto erase where the controller supports it, else user data
erase; other disks: secure discard, a plain discard only where the device has none), a mounted
disk unmounted first, then the tenant's files removed. Run through the agent's HTTP API against
recorded outputs of the real tools (`tests/fixtures/tools/`): every argv is the documented one,
every failure fails the wipe closed (422 naming the step and the tool's words, the node still
the tenant's), and the answer lists the steps."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpucloud.agent.app import Agent
from gpucloud.agent.cleaning import format_nvm_attributes, mountpoints_of
from gpucloud.agent.host import HostState
from gpucloud.agent.tools import CommandResult, CommandRunner
from gpucloud.cli.main import app as cli
from gpucloud.sim.probe import SimulatedProbe
from support.agents import agent_test_client

pytestmark = pytest.mark.unit

RECORDED = Path(__file__).parent.parent / "fixtures" / "tools"

# The documented command lines (see the comments in gpucloud/agent/cleaning.py).
RESET = ("nvidia-smi", "--gpu-reset")


def id_ctrl(disk: str) -> tuple[str, ...]:
    return ("nvme", "id-ctrl", disk, "-o", "json")


def crypto_erase(disk: str) -> tuple[str, ...]:
    return ("nvme", "format", disk, "--ses=2", "--force")


def user_data_erase(disk: str) -> tuple[str, ...]:
    return ("nvme", "format", disk, "--ses=1", "--force")


SECURE_DISCARD = ("blkdiscard", "--secure", "/dev/sdb")
DISCARD = ("blkdiscard", "/dev/sdb")
DISKS = ("/dev/nvme1n1", "/dev/nvme2n1", "/dev/sdb")
CLEAN = {
    RESET: (0, "nvidia-smi-gpu-reset-ok.txt"),
    id_ctrl("/dev/nvme1n1"): (0, "nvme-id-ctrl-crypto-erase.json"),
    crypto_erase("/dev/nvme1n1"): (0, "nvme-format-ok.txt"),
    id_ctrl("/dev/nvme2n1"): (0, "nvme-id-ctrl-no-crypto-erase.json"),
    user_data_erase("/dev/nvme2n1"): (0, "nvme-format-ok.txt"),
    SECURE_DISCARD: (0, "blkdiscard-ok.txt"),
}
# The node's root filesystem on another drive; a partition of the first tenant disk mounted at a
# path with a space (written as \040); a namespace whose name only starts like the first disk's.
MOUNTS = (
    "/dev/nvme0n1p2 / ext4 rw,relatime 0 0\n"
    "proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0\n"
    "/dev/nvme1n1p1 /mnt/tenant\\040data xfs rw,relatime 0 0\n"
    "/dev/nvme1n10 /mnt/other xfs rw,relatime 0 0\n"
)
UNMOUNT = ("umount", "/mnt/tenant data")


class RecordedTools(CommandRunner):
    """Answers each documented argv with its recorded output (any other argv fails the test), and
    notes whether the tenant's file was still there when each ran."""

    def __init__(self, outputs, *, disks, installed, tenant_file: Path) -> None:
        self.outputs, self.disks, self.installed, self.tenant_file = outputs, set(disks), installed, tenant_file
        self.ran: list[tuple[str, ...]] = []
        self.files_there: list[bool] = []

    def which(self, tool: str) -> str | None:
        return f"/usr/bin/{tool}" if self.installed is None or tool in self.installed else None

    def is_block_device(self, path: str) -> bool:
        return path in self.disks

    def run(self, argv, timeout_s):
        self.ran.append(argv)
        self.files_there.append(self.tenant_file.exists())
        assert argv in self.outputs, f"undocumented command line {argv}"
        returncode, name = self.outputs[argv]
        return CommandResult(returncode, (RECORDED / name).read_text())


@contextmanager
def _released_node(
    tmp_path: Path, outputs=None, *, disks=DISKS, present=DISKS, mounts: str | None = "", installed=None
):
    """A node provisioned for tenant t-a and released, with a file of its tenant in scratch: its
    HTTP client, its tools, its state. `disks`: the agent's tenant disks; `present`: the block
    devices the node has."""
    scratch = tmp_path / "scratch"
    tools = RecordedTools(
        {**CLEAN, UNMOUNT: (0, "blkdiscard-ok.txt"), **(outputs or {})},
        disks=present,
        installed=installed,
        tenant_file=scratch / "data",
    )
    if mounts is not None:
        (tmp_path / "mounts").write_text(mounts)
    state = HostState(node_id="gpu-1", boot_id="b", scratch_dir=scratch, credential="gpa_gpu-1.first")
    probe = SimulatedProbe("gpu-1", gpu_count=8)
    agent = Agent(state, probe, runner=tools, tenant_disks=disks, mounts_file=tmp_path / "mounts")
    with agent_test_client(agent) as client:
        assert client.post("/actions/provision", json={"request_id": "p", "tenant_id": "t-a"}).status_code == 200
        assert client.post("/actions/release", json={"request_id": "r"}).status_code == 200
        scratch.mkdir(parents=True, exist_ok=True)
        (scratch / "data").write_text("the tenant's")
        tools.ran.clear()
        yield client, tools, state


def _wipe(client, request_id: str = "w1"):
    return client.post("/actions/wipe", json={"request_id": request_id, "credential": "gpa_gpu-1.second"})


def test_a_wipe_resets_then_sanitizes_each_disk_then_removes_the_tenants_files(tmp_path):
    with _released_node(tmp_path, mounts=MOUNTS) as (client, tools, state):
        wiped = _wipe(client)
        assert wiped.status_code == 200, wiped.json()
        assert tools.ran == [
            RESET,
            UNMOUNT,  # the mounted partition of the first disk, before its erase; nothing else
            id_ctrl("/dev/nvme1n1"),
            crypto_erase("/dev/nvme1n1"),  # fna bit 2 set
            id_ctrl("/dev/nvme2n1"),
            user_data_erase("/dev/nvme2n1"),  # fna bit 2 clear
            SECURE_DISCARD,
        ]
        assert all(tools.files_there)  # the tenant's files went after the hardware was clean
        assert not (tmp_path / "scratch" / "data").exists()
        cleaning = wiped.json()["cleaning"]
        assert [(s["step"], s["target"], s["method"], s["ok"]) for s in cleaning] == [
            ("gpu_reset", "every GPU", "gpu_reset", True),
            ("disk_sanitize", "/dev/nvme1n1", "crypto_erase", True),
            ("disk_sanitize", "/dev/nvme2n1", "user_data_erase", True),
            ("disk_sanitize", "/dev/sdb", "secure_discard", True),
            ("scratch", str(tmp_path / "scratch"), "remove", True),
        ]
        assert "was successfully reset" in cleaning[0]["answer"]
        assert cleaning[1]["answer"].startswith("unmounted /mnt/tenant data; nvme format /dev/nvme1n1 --ses=2 --force")
        assert "Success formatting namespace:1" in cleaning[1]["answer"]
        assert all(len(s["answer"]) <= 300 for s in cleaning)
        assert wiped.json()["tenant_id"] is None and state.credential == "gpa_gpu-1.second"
        # A retried request is answered from memory: nothing runs twice.
        assert _wipe(client).json() == wiped.json() and len(tools.ran) == 7


def test_a_device_without_secure_discard_gets_a_plain_discard_and_says_so(tmp_path):
    with _released_node(
        tmp_path,
        {SECURE_DISCARD: (1, "blkdiscard-secure-unsupported.txt"), DISCARD: (0, "blkdiscard-ok.txt")},
        disks=("/dev/sdb",),
    ) as (client, tools, _):
        wiped = _wipe(client)
        assert wiped.status_code == 200, wiped.json()
        assert tools.ran == [RESET, SECURE_DISCARD, DISCARD]
        disk = wiped.json()["cleaning"][1]
        assert disk["method"] == "discard" and "BLKSECDISCARD ioctl failed: Operation not supported" in disk["answer"]


FAILURES = [
    # (what the tool answers, the step that fails, what the detail must say, the last argv run)
    ({RESET: (0, "nvidia-smi-gpu-reset-in-use.txt")}, "gpu_reset", "nvidia-smi could not reset every GPU", RESET),
    ({RESET: (255, "nvidia-smi-gpu-reset-in-use.txt")}, "gpu_reset", "nvidia-smi --gpu-reset exited 255", RESET),
    (
        {crypto_erase("/dev/nvme1n1"): (1, "nvme-format-invalid-field.txt")},
        "disk_sanitize",
        "/dev/nvme1n1: nvme format /dev/nvme1n1 --ses=2 --force exited 1: NVMe status: Invalid Field in Command",
        crypto_erase("/dev/nvme1n1"),
    ),
    # Exit 0 is not enough: the drive's status is in what nvme-cli printed.
    (
        {crypto_erase("/dev/nvme1n1"): (0, "nvme-format-invalid-format.txt")},
        "disk_sanitize",
        "NVMe status: INVALID_FORMAT: The LBA Format specified is not supported",
        crypto_erase("/dev/nvme1n1"),
    ),
    (
        {id_ctrl("/dev/nvme1n1"): (0, "nvme-format-ok.txt")},
        "disk_sanitize",
        "nvme id-ctrl printed no Format NVM Attributes (fna)",
        id_ctrl("/dev/nvme1n1"),
    ),
    (
        {SECURE_DISCARD: (1, "blkdiscard-secure-unsupported.txt"), DISCARD: (1, "blkdiscard-unsupported.txt")},
        "disk_sanitize",
        "blkdiscard /dev/sdb exited 1: blkdiscard: /dev/sdb: BLKDISCARD ioctl failed: Operation not supported",
        DISCARD,
    ),
    (
        {SECURE_DISCARD: (1, "umount-busy.txt")},  # any other failure of the secure discard: no fallback
        "disk_sanitize",
        "blkdiscard --secure /dev/sdb exited 1",
        SECURE_DISCARD,
    ),
]


@pytest.mark.parametrize(("outputs", "step", "why", "last"), FAILURES, ids=[f[2][:40] for f in FAILURES])
def test_each_failure_fails_the_wipe_closed_naming_the_step_and_the_tools_words(tmp_path, outputs, step, why, last):
    with _released_node(tmp_path, outputs) as (client, tools, state):
        failed = _wipe(client)
        body = failed.json()
        assert failed.status_code == 422 and body["title"] == "Action failed", body
        assert body["detail"].startswith(f"wipe: {step} ") and why in body["detail"], body["detail"]
        assert tools.ran[-1] == last  # it stopped at the failing tool
        # The steps taken, the failed one last before the files' removal.
        assert (
            body["step"] == step and body["cleaning"][-2]["ok"] is False and body["cleaning"][-1]["step"] == "scratch"
        )
        # The tenant's files go all the same, but the node is still the tenant's and keeps the old
        # credential: burn-in refuses it, and only a wipe that passes hands it over.
        assert not (tmp_path / "scratch" / "data").exists()
        assert state.tenant_id == "t-a" and state.credential == "gpa_gpu-1.first"
        assert client.post("/actions/burn_in", json={"request_id": "b"}).status_code == 409


def test_a_disk_still_mounted_after_umount_fails_fails_the_wipe_naming_the_mount(tmp_path):
    with _released_node(tmp_path, {UNMOUNT: (32, "umount-busy.txt")}, mounts=MOUNTS) as (client, tools, state):
        failed = _wipe(client)
        assert failed.status_code == 422
        detail = failed.json()["detail"]
        assert "/dev/nvme1n1 is mounted at /mnt/tenant data" in detail and "target is busy" in detail, detail
        assert tools.ran == [RESET, UNMOUNT]  # never formatted under a mounted filesystem
        assert state.tenant_id == "t-a"


def test_a_disk_is_not_erased_when_the_mounts_cannot_be_read(tmp_path):
    with _released_node(tmp_path, mounts=None) as (client, tools, state):
        failed = _wipe(client)
        assert failed.status_code == 422
        assert f"cannot read {tmp_path / 'mounts'} to see whether /dev/nvme1n1 is mounted" in failed.json()["detail"]
        assert tools.ran == [RESET] and state.tenant_id == "t-a"


def test_a_disk_that_does_not_exist_fails_the_wipe_before_anything_runs(tmp_path):
    with _released_node(tmp_path, disks=("/dev/nvme1n1", "/dev/nvme9n1")) as (client, tools, state):
        failed = _wipe(client)
        assert failed.status_code == 422
        assert (
            "no block device at /dev/nvme9n1" in failed.json()["detail"] and "--tenant-disk" in failed.json()["detail"]
        )
        assert tools.ran == [] and state.tenant_id == "t-a"


def test_without_tenant_disks_the_wipe_resets_and_says_no_disk_is_configured(tmp_path):
    with _released_node(tmp_path, disks=()) as (client, tools, _):
        wiped = _wipe(client)
        assert wiped.status_code == 200 and tools.ran == [RESET]
        disk = wiped.json()["cleaning"][1]
        assert disk["step"] == "disk_sanitize" and disk["method"] == "none"
        assert "no tenant disks are configured" in disk["answer"]


def test_a_missing_tool_is_a_501_naming_it_and_nothing_runs(tmp_path):
    with _released_node(tmp_path, installed={"nvidia-smi", "blkdiscard"}) as (client, tools, state):
        missing = _wipe(client)
        assert missing.status_code == 501 and missing.json()["tools"] == ["nvme"]
        assert tools.ran == [] and state.tenant_id == "t-a"


def test_the_format_nvm_attributes_and_the_mounts_are_read_as_documented():
    assert format_nvm_attributes((RECORDED / "nvme-id-ctrl-crypto-erase.json").read_text()) == 4
    assert format_nvm_attributes((RECORDED / "nvme-id-ctrl-no-crypto-erase.json").read_text()) == 0
    assert format_nvm_attributes((RECORDED / "nvme-format-invalid-field.txt").read_text()) is None
    assert mountpoints_of("/dev/nvme1n1", MOUNTS) == ["/mnt/tenant data"]
    assert mountpoints_of("/dev/nvme1n10", MOUNTS) == ["/mnt/other"]
    assert mountpoints_of(
        "/dev/sdb", "/dev/sdb /a ext4 rw 0 0\n/dev/sdb2 /b ext4 rw 0 0\n/dev/sdbc1 /c ext4 rw 0 0\n"
    ) == [
        "/a",
        "/b",
    ]


def test_the_agent_command_takes_tenant_disks(monkeypatch, tmp_path):
    help_text = CliRunner().invoke(cli, ["agent", "--help"], env={"COLUMNS": "200"}).output
    assert "--tenant-disk" in help_text and "erased by the drive on every wipe" in help_text
    started: dict = {}
    monkeypatch.setattr("gpucloud.entrypoints.agent.main", lambda **kwargs: started.update(kwargs))
    args = ["agent", "--node-id", "n-1", "--token", "gpa_n-1.s", "--token-file", str(tmp_path / "none")]
    ran = CliRunner().invoke(cli, [*args, "--tenant-disk", "/dev/nvme1n1", "--tenant-disk", "/dev/sdb"])
    assert ran.exit_code == 0, ran.output
    assert started["tenant_disks"] == ("/dev/nvme1n1", "/dev/sdb")
    typo = CliRunner().invoke(cli, [*args, "--tenant-disk", "nvme1n1"])
    assert typo.exit_code == 2 and "nvme1n1 is not a device path" in typo.output
