"""The node protocol's actions: what the control plane asks of a node's agent (the real one or a
simulated node) at `POST /actions/{action}`, and what it hands over with them. Both ends, and the
workflows that sequence the actions, import them from here."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpucloud.models.images import ImageReference
from gpucloud.protocol.reports import NodeId, ShortId, SignalObservation, TenantId

# One OpenSSH public key, as a `.pub` file holds it: its type, its base64 blob, an optional comment;
# no options (`command=`, `from=`) and one line (a newline would add a line to authorized_keys).
SSH_PUBLIC_KEY_PATTERN = (
    r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)|sk-ssh-ed25519@openssh\.com"
    r"|sk-ecdsa-sha2-nistp256@openssh\.com) [A-Za-z0-9+/]+={0,3}( [^\r\n]*)?$"
)
SSH_KEY_TYPES = "ssh-ed25519, ssh-rsa, ecdsa-sha2-nistp256/384/521, sk-ssh-ed25519@openssh.com, sk-ecdsa-..."

# A booted image's digest, as the clean image writes it for its agent.
IMAGE_DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
ImageDigest = Annotated[str, Field(pattern=IMAGE_DIGEST_PATTERN)]


class AgentAction(StrEnum):
    """The actions every agent serves at `POST /actions/{action}`."""

    INSPECT = "inspect"
    BURN_IN = "burn_in"
    PROVISION = "provision"
    RELEASE = "release"
    WIPE = "wipe"
    RESET = "reset"
    REBOOT = "reboot"
    REFLASH = "reflash"
    # Short scheduled diagnostics of an idle node (`dcgmi diag -r 1`, a single-node NCCL
    # all-reduce, nvbandwidth): never on a node a tenant holds (the agent refuses it, 409).
    DIAGNOSE = "diagnose"


def known_action(name: str) -> AgentAction | None:
    """The action of that name; None for one no agent serves (the agent answers 404)."""
    try:
        return AgentAction(name)
    except ValueError:
        return None


# The repair ladder's rungs, mildest first: a fault that a rung fixes is fixed by every later one.
REPAIR_LADDER = (AgentAction.RESET, AgentAction.REBOOT, AgentAction.REFLASH)


class Workload(BaseModel):
    """What the tenant runs on each node of its allocation: started by provision in a process
    tree the agent owns, stopped by release (`gpucloud.agent.workloads`)."""

    model_config = ConfigDict(extra="forbid")

    command: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="argv: the program and its arguments (with an image: run in it instead of its entrypoint)",
    )
    image: ImageReference | None = Field(
        None,
        description="a container image to run (nodes with podman or docker); without one the command runs on the host",
    )
    env: dict[str, str] = Field(default_factory=dict, max_length=256)
    ssh_keys: list[str] = Field(
        default_factory=list, max_length=64, description="public keys let in to the nodes (authorized_keys)"
    )
    progress_timeout_s: float | None = Field(
        None,
        ge=10,
        le=7 * 86_400,
        description=(
            "the workload touches the file named by $GPUCLOUD_PROGRESS_FILE at least this often (like NCCL's "
            "watchdog); one that runs on without doing so is reported as hung: counted, never a reason to pull "
            "the node (host workloads)"
        ),
    )

    @field_validator("ssh_keys")
    @classmethod
    def _public_keys(cls, keys: list[str]) -> list[str]:
        """Each key as one `.pub` line (surrounding whitespace dropped); a private key, an option
        or a second line is refused, naming the key by its place."""
        kept = []
        for index, key in enumerate(keys):
            line = key.strip()
            if len(line) > 16_384 or re.match(SSH_PUBLIC_KEY_PATTERN, line) is None:
                raise ValueError(
                    f"ssh_keys[{index}] is not an OpenSSH public key on one line ({SSH_KEY_TYPES}, then base64, "
                    "then an optional comment): pass the .pub file's content, never the private key"
                )
            kept.append(line)
        return kept

    @model_validator(mode="after")
    def _something_to_run(self) -> Workload:
        if not self.command and self.image is None:
            raise ValueError("a workload names a command, an image, or both")
        return self


class ActionRequest(BaseModel):
    request_id: str = Field(min_length=1, max_length=300)
    tenant_id: TenantId | None = None
    # The allocation a provision is for: what the node's usage is metered against.
    allocation_id: str | None = Field(None, min_length=1, max_length=200)
    # A wipe's next agent credential (`gpa_<node id>.<secret>`): the agent reports with it once
    # the wipe succeeded; the control plane then revokes the old one.
    credential: str | None = Field(None, min_length=1, max_length=300)
    # What a provision starts on the node (None: the node is handed over with nothing running).
    workload: Workload | None = None


# The steps of a wipe's cleaning, in the order the agent takes them (`CleaningStep.step`).
GPU_RESET, DISK_SANITIZE, SCRATCH = "gpu_reset", "disk_sanitize", "scratch"
CLEANING_ANSWER_CHARS = 300


class CleaningStep(BaseModel):
    """One step of a wipe's cleaning as the agent took it: a GPU reset, a sanitize of one of the
    tenant's disks, the removal of its files. Both the real agent and the simulated fleet answer
    with these, and the control plane records each as an event in the node's history."""

    step: str = Field(pattern=r"^[a-z_]{1,40}$", description="gpu_reset, disk_sanitize or scratch")
    target: str = Field(max_length=300, description="what it cleaned: the GPUs, a disk's device, a directory")
    method: str = Field(
        pattern=r"^[a-z_]{1,40}$",
        description="gpu_reset; crypto_erase, user_data_erase, secure_discard or discard; remove",
    )
    ok: bool
    answer: str = Field("", description=f"what the tool said, at most {CLEANING_ANSWER_CHARS} characters")

    @field_validator("answer", mode="before")
    @classmethod
    def _short(cls, value: object) -> object:
        """A tool's whole output on one line, cut to fit an event's cause."""
        if isinstance(value, str):
            return " ".join(value.split())[:CLEANING_ANSWER_CHARS]
        return value


class DiagnosticCheck(BaseModel):
    """One tool of a diagnose as the agent ran it: `pass`, `fail` (its figures or results are
    below the bar: a signal rides along in `Diagnosis.observations`), `error` (it ran and said
    nothing that can be judged), or `not_run` (not installed on the node: never a pass)."""

    tool: str = Field(pattern=r"^[a-z_]{1,40}$", description="dcgmi, all_reduce_perf or nvbandwidth")
    status: Literal["pass", "fail", "error", "not_run"]
    detail: str = Field("", max_length=CLEANING_ANSWER_CHARS)

    @field_validator("detail", mode="before")
    @classmethod
    def _short(cls, value: object) -> object:
        if isinstance(value, str):
            return " ".join(value.split())[:CLEANING_ANSWER_CHARS]
        return value


class Diagnosis(BaseModel):
    """A diagnose's answer: each tool's check, and what they found as signal observations, which
    the control plane judges with the signal table as it judges any node's signals."""

    checks: list[DiagnosticCheck] = Field(default_factory=list, max_length=16)
    observations: list[SignalObservation] = Field(default_factory=list, max_length=64)

    def summary(self) -> str:
        return "; ".join(f"{c.tool}: {c.status}" + (f" ({c.detail})" if c.detail else "") for c in self.checks)


class ActionAnswer(BaseModel):
    """What an agent answers a successful action: the action and the node's tenancy after it.
    What the node's hardware adds rides along as extra fields: its GPUs as the probe reads them
    (`is_gpu_node`, `fatal_error`) and, where a workload runner runs the tenant's processes, its
    status (`workload_status`)."""

    model_config = ConfigDict(extra="allow")

    action: AgentAction
    node_id: NodeId
    tenant_id: TenantId | None = None
    workload_running: bool = False
    gpu_count: int = Field(ge=0)
    # What a re-image checks (`activities/bmc.py`): the boot the answer comes from, and the
    # digest of the image it booted (`gpucloud agent --image-digest-file`; the simulated node's).
    boot_id: ShortId | None = None
    image_digest: ImageDigest | None = None
    # A wipe's cleaning, step by step (None: an answer to another action, or from an agent that
    # does not report its steps).
    cleaning: list[CleaningStep] | None = Field(None, max_length=64)
    # A diagnose's checks and findings (None: an answer to another action).
    diagnosis: Diagnosis | None = None
