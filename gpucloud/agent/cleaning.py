"""What a wipe does to the hardware before the node goes back to the pool: the tenant had root on
it, so its GPUs are reset and the disks it wrote to are erased by the drive itself, not merely
emptied of files.

In order: a reset of every GPU (the repair ladder's reset rung, judged the same way), then a
sanitize of each tenant disk the operator named (`gpucloud agent --tenant-disk`): an NVMe
namespace gets a Format NVM with a cryptographic erase where its controller supports one, else a
user data erase; any other block device a secure discard, or a plain discard only where the
device says it has no secure one. A mounted disk is unmounted first. The agent removes the
tenant's files after these (`Agent._wipe_scratch`).

Each step is judged by its tool's exit status and by what the tool printed (recorded outputs from
each tool's documentation: `tests/fixtures/tools/`); the first that fails stops the cleaning, and
the wipe fails naming the step and the tool's words. Nothing is reported clean that was not.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from gpucloud.agent.tools import ACTION_COMMANDS, CommandResult, CommandRunner, action_failure
from gpucloud.protocol.actions import DISK_SANITIZE, GPU_RESET, AgentAction, CleaningStep

# nvme-id-ctrl(1): `nvme id-ctrl <device>` takes the controller's character device or a namespace
# block device (and, through it, asks the namespace's own controller: the numbers in the names
# need not match, nvme-format(1) warns); `-o json` (`--output-format`) prints the Identify
# Controller structure as JSON, its Format NVM Attributes as `fna`.
NVME_ID_CTRL = ("nvme", "id-ctrl", "{device}", "-o", "json")
# NVMe base specification, Identify Controller, FNA bit 2: "Cryptographic Erase Supported". (Bits
# 0 and 1 say a format, or a secure erase, of one namespace reaches all of the controller's: the
# operator names only disks that are wholly the tenant's.)
FNA_CRYPTO_ERASE = 1 << 2
# nvme-format(1): `--ses` Secure Erase Settings, 1 "User Data Erase", 2 "Cryptographic Erase";
# `--force` "just send the command immediately without warning of the implications" (without it
# the tool waits 10 s for a Ctrl-C). Without `--lbaf` a namespace keeps its LBA format.
NVME_CRYPTO_ERASE = ("nvme", "format", "{device}", "--ses=2", "--force")
NVME_USER_DATA_ERASE = ("nvme", "format", "{device}", "--ses=1", "--force")
# blkdiscard(8) (util-linux): `-s, --secure` "Perform a secure discard ... all copies of the
# discarded blocks that were possibly created by garbage collection must also be erased. This
# requires support from the device"; without it, a discard of the whole device.
BLKDISCARD_SECURE = ("blkdiscard", "--secure", "{device}")
BLKDISCARD = ("blkdiscard", "{device}")
# umount(8): `umount <mountpoint>`.
UMOUNT = ("umount", "{mountpoint}")

# What nvme-cli prints when the drive refused the command (nvme-cli 2 and 1 spell the status
# differently: "NVMe status: Invalid Field in Command: ...(0x4002)", "NVMe status: INVALID_FORMAT:
# ...(0x410a)", "NVME Admin command error:..."), or when it could not open the device. Some
# statuses leave nvme-cli's exit status 0, so the words are read too.
_NVME_REFUSED = re.compile(r"NVMe status:|NVME Admin command error|Failed to open|ioctl|failed", re.IGNORECASE)
# blkdiscard(8)'s words for a device without secure discard (err(3) appends strerror(EOPNOTSUPP)):
# "blkdiscard: /dev/sdb: BLKSECDISCARD ioctl failed: Operation not supported".
_NO_SECURE_DISCARD = re.compile(r"BLKSECDISCARD ioctl failed: Operation not supported")
_BLKDISCARD_FAILED = re.compile(r"ioctl failed|cannot open|not a block device", re.IGNORECASE)


class CleaningFailed(Exception):
    """A cleaning step failed; its message names the step, its target and the tool's words."""

    def __init__(self, step: CleaningStep, why: str) -> None:
        super().__init__(f"{step.step} {step.target}: {why}")
        self.step = step


@dataclass
class Cleaner:
    """Resets the GPUs and sanitizes the tenant's disks through `runner` (tests pass their own);
    `mounts_file` is where the mounted filesystems are listed (`/proc/mounts`)."""

    runner: CommandRunner
    tenant_disks: tuple[str, ...] = ()
    mounts_file: Path = Path("/proc/mounts")
    timeout_s: float = 3600.0
    steps: list[CleaningStep] = field(default_factory=list)

    def tools_missing(self) -> list[str]:
        """The tools this wipe needs that are not installed (the agent answers 501 naming them)."""
        needed = [ACTION_COMMANDS[AgentAction.RESET][0][0]]
        needed += ["nvme" if is_nvme(disk) else "blkdiscard" for disk in self.tenant_disks]
        listed = self._listed_mounts()
        if self.tenant_disks and (listed is None or any(mountpoints_of(disk, listed) for disk in self.tenant_disks)):
            needed.append("umount")
        return sorted({tool for tool in needed if self.runner.which(tool) is None})

    def clean(self) -> list[CleaningStep]:
        """Every step taken, in order. On a failure it raises `CleaningFailed`, and `steps` holds
        the steps taken, the failed one last."""
        self.steps = []
        # An operator's typo must not pass as a clean disk: every disk is checked before anything runs.
        for disk in self.tenant_disks:
            if not self.runner.is_block_device(disk):
                self._fail(
                    CleaningStep(step=DISK_SANITIZE, target=disk, method="check", ok=False),
                    f"no block device at {disk}: correct the agent's --tenant-disk",
                )
        self._reset_gpus()
        for disk in self.tenant_disks:
            self._sanitize(disk)
        if not self.tenant_disks:
            self.steps.append(
                CleaningStep(
                    step=DISK_SANITIZE,
                    target="",
                    method="none",
                    ok=True,
                    answer="no tenant disks are configured (gpucloud agent --tenant-disk): no disk was sanitized",
                )
            )
        return self.steps

    def _reset_gpus(self) -> None:
        for argv in ACTION_COMMANDS[AgentAction.RESET]:
            step = CleaningStep(step=GPU_RESET, target="every GPU", method="gpu_reset", ok=False)
            result = self._run(step, argv)
            if why := action_failure(argv[0], result.output):
                self._fail(step, why)
            self._passed(step, result.output or f"{' '.join(argv)} exited 0")

    def _sanitize(self, disk: str) -> None:
        listed = self._listed_mounts()
        if listed is None:  # a disk that may be mounted is not erased under its filesystem
            self._fail(
                CleaningStep(step=DISK_SANITIZE, target=disk, method="unmount", ok=False),
                f"cannot read {self.mounts_file} to see whether {disk} is mounted",
            )
        # The last mounted first: a mount on top of another comes off before it.
        mounted = list(reversed(mountpoints_of(disk, listed)))
        unmounted = [self._unmount(disk, mountpoint) for mountpoint in mounted]
        done = f"unmounted {', '.join(unmounted)}; " if unmounted else ""
        step, answer = self._nvme_format(disk) if is_nvme(disk) else self._discard(disk)
        self._passed(step, done + answer)

    def _nvme_format(self, disk: str) -> tuple[CleaningStep, str]:
        probe = CleaningStep(step=DISK_SANITIZE, target=disk, method="identify", ok=False)
        identified = self._run(probe, _fill(NVME_ID_CTRL, device=disk))
        fna = format_nvm_attributes(identified.output)
        if fna is None:
            self._fail(probe, "nvme id-ctrl printed no Format NVM Attributes (fna) to choose an erase by")
        crypto = bool(fna & FNA_CRYPTO_ERASE)
        argv = _fill(NVME_CRYPTO_ERASE if crypto else NVME_USER_DATA_ERASE, device=disk)
        step = CleaningStep(
            step=DISK_SANITIZE, target=disk, method="crypto_erase" if crypto else "user_data_erase", ok=False
        )
        result = self._run(step, argv)
        if _NVME_REFUSED.search(result.output):
            self._fail(step, f"{' '.join(argv)}: {result.output}")
        return step, f"{' '.join(argv)}: {result.output or 'exited 0'}"

    def _discard(self, disk: str) -> tuple[CleaningStep, str]:
        step = CleaningStep(step=DISK_SANITIZE, target=disk, method="secure_discard", ok=False)
        argv, note = _fill(BLKDISCARD_SECURE, device=disk), ""
        result = self._call(argv)
        if isinstance(result, CommandResult) and result.returncode != 0 and _NO_SECURE_DISCARD.search(result.output):
            # The device has no secure discard: a discard of every block is the most it can do,
            # and the step says which one it got.
            step = step.model_copy(update={"method": "discard"})
            argv, note = _fill(BLKDISCARD, device=disk), f"no secure discard ({' '.join(result.output.split())}); "
            result = self._call(argv)
        done = self._judge(step, argv, result)
        if _BLKDISCARD_FAILED.search(done.output):
            self._fail(step, f"{' '.join(argv)}: {done.output}")
        return step, f"{note}{' '.join(argv)}: {done.output or 'exited 0'}"

    def _unmount(self, disk: str, mountpoint: str) -> str:
        step = CleaningStep(step=DISK_SANITIZE, target=disk, method="unmount", ok=False)
        argv = _fill(UMOUNT, mountpoint=mountpoint)
        result = self._call(argv)
        if isinstance(result, str) or result.returncode != 0:
            words = result if isinstance(result, str) else f"exited {result.returncode}: {result.output}"
            self._fail(step, f"{disk} is mounted at {mountpoint} and `umount {mountpoint}` failed ({words})")
        return mountpoint

    def _listed_mounts(self) -> str | None:
        try:
            return self.mounts_file.read_text()
        except OSError:
            return None

    def _call(self, argv: tuple[str, ...]) -> CommandResult | str:
        try:
            return self.runner.run(argv, self.timeout_s)
        except subprocess.TimeoutExpired:
            return f"{argv[0]} ran past {self.timeout_s:g} s"

    def _run(self, step: CleaningStep, argv: tuple[str, ...]) -> CommandResult:
        return self._judge(step, argv, self._call(argv))

    def _judge(self, step: CleaningStep, argv: tuple[str, ...], result: CommandResult | str) -> CommandResult:
        if isinstance(result, str):
            self._fail(step, result)
        if result.returncode != 0:
            self._fail(step, f"{' '.join(argv)} exited {result.returncode}: {result.output[-300:]}")
        return result

    def _passed(self, step: CleaningStep, answer: str) -> None:
        self.steps.append(CleaningStep(**(step.model_dump() | {"ok": True, "answer": answer})))

    def _fail(self, step: CleaningStep, why: str) -> NoReturn:
        failed = CleaningStep(**(step.model_dump() | {"ok": False, "answer": why}))
        self.steps.append(failed)
        raise CleaningFailed(failed, " ".join(why.split()))


def is_nvme(disk: str) -> bool:
    """An NVMe namespace's block device (`/dev/nvme1n1`), as the kernel names them."""
    return os.path.basename(os.path.realpath(disk)).startswith("nvme")


def format_nvm_attributes(output: str) -> int | None:
    """The controller's `fna` from `nvme id-ctrl -o json`; None when the output holds none."""
    start, end = output.find("{"), output.rfind("}")
    try:
        document = json.loads(output[start : end + 1]) if start >= 0 else None
    except json.JSONDecodeError:
        return None
    fna = document.get("fna") if isinstance(document, dict) else None
    return fna if isinstance(fna, int) and not isinstance(fna, bool) else None


def mountpoints_of(disk: str, mounts: str) -> list[str]:
    """Where `disk` or a partition of it is mounted, in the order of `mounts` (proc_pid_mounts(5):
    source, mount point, ..., with spaces and the like written as octal escapes)."""
    device = os.path.realpath(disk)
    # A partition's name is the disk's plus its number, with a "p" between where the disk's name
    # ends in a digit (nvme1n1p2, sdb2): nvme1n10 is another namespace, not a partition of nvme1n1.
    partition = re.compile(re.escape(device) + (r"p\d+" if device[-1:].isdigit() else r"\d+"))
    found = []
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 2 or not fields[0].startswith("/"):
            continue
        source = os.path.realpath(_unescape(fields[0]))
        if source == device or partition.fullmatch(source):
            found.append(_unescape(fields[1]))
    return found


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _fill(template: tuple[str, ...], **values: str) -> tuple[str, ...]:
    return tuple(arg.format(**values) if arg.startswith("{") else arg for arg in template)
