"""What a node's agent knows about the node's tenancy, kept across its restarts, and the node's
identity (its boot, its credential, its GPU type)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from gpucloud.agent.spool import NodeAllocation
from gpucloud.config import write_private
from gpucloud.models.catalog import GPU_TYPES
from gpucloud.protocol.actions import IMAGE_DIGEST_PATTERN
from gpucloud.protocol.reports import Heartbeat, NodeReading, WorkloadStatus


@dataclass
class HostState:
    """What the agent knows about the node's tenancy; the control plane reads it in heartbeats."""

    node_id: str
    boot_id: str
    scratch_dir: Path
    tenant_id: str | None = None
    workload_running: bool = False
    # What the meter bills the node's GPU time to (None: nothing ran since the agent started).
    allocation: NodeAllocation | None = None
    recent: OrderedDict = field(default_factory=OrderedDict)  # request_id -> (status, body)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Held by the meter while it reads the allocation and cuts its usage (`spool.Meter.tick`).
    meter_lock: threading.Lock = field(default_factory=threading.Lock)
    # The node's agent credential the reports carry; a wipe replaces it.
    credential: str | None = None
    credential_file: Path | None = None
    # Where the tenancy above is kept across the agent's restarts (None: memory only).
    state_file: Path | None = None
    # The digest of the image this boot came from (`sha256:<hex>`), as the image wrote it for its
    # agent (`read_image_digest`); a re-image checks it against what the BMC inserted. None: the
    # host was not booted from a known image.
    image_digest: str | None = None

    def save(self) -> None:
        """Keep the tenant, whether it holds the node, and the allocation metered (0600): an
        agent restarted while a tenant holds the node still stops its workload and meters it."""
        if self.state_file is None:
            return
        kept = {
            "tenant_id": self.tenant_id,
            "workload_running": self.workload_running,
            "allocation": dataclasses.asdict(self.allocation) if self.allocation else None,
        }
        write_private(self.state_file, json.dumps(kept))

    def restore(self) -> None:
        """What `save` kept, if anything (the boot id is this boot's: a reboot is seen)."""
        if self.state_file is None or not self.state_file.is_file():
            return
        kept = json.loads(self.state_file.read_text())
        self.tenant_id, self.workload_running = kept.get("tenant_id"), bool(kept.get("workload_running"))
        if kept.get("allocation"):
            self.allocation = NodeAllocation(**kept["allocation"])

    def take_credential(self, credential: str) -> None:
        """Report with `credential` from now on, and keep it (0600) for the next start."""
        self.credential = credential
        if self.credential_file is not None:
            write_credential(self.credential_file, credential)

    def heartbeat(self, workload: WorkloadStatus | None = None) -> Heartbeat:
        """The node's heartbeat; raises `ValidationError` on a state the protocol refuses."""
        return Heartbeat(
            node_id=self.node_id,
            tenant_id=self.tenant_id,
            workload_running=self.workload_running,
            boot_id=self.boot_id,
            workload=workload,
        )


def gpu_type_of(reading: NodeReading) -> str:
    """The catalogue's GPU type from NVML's device name ("NVIDIA H100 80GB HBM3" -> "H100");
    longest first, so a GB200 is not taken for a B200."""
    name = reading.gpus[0].name.upper() if reading.gpus else ""
    return next((t for t in sorted(GPU_TYPES, key=len, reverse=True) if t in name), name or "unknown")


def write_credential(path: Path, credential: str) -> None:
    write_private(path, credential + "\n")


def read_boot_id() -> str:
    path = Path("/proc/sys/kernel/random/boot_id")
    return path.read_text().strip() if path.exists() else uuid.uuid4().hex


def read_image_digest(path: Path) -> str | None:
    """The booted image's digest as the image wrote it (`sha256:<64 hex>`), None without one.
    It is the image's word through its agent, not an attestation (README, Known gaps)."""
    if not path.is_file():
        return None
    digest = path.read_text().strip()
    if re.match(IMAGE_DIGEST_PATTERN, digest) is None:
        raise SystemExit(f"{path} holds {digest[:80]!r}, not an image digest (sha256:<64 hex>)")
    return digest
