"""The host agent's wire models: what the control plane sends to an agent (the real one or a
simulated node) and what it answers. Both ends import them from here."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpucloud.agent.readings import ShortId
from gpucloud.models.images import ImageReference

# The actions every agent serves at `POST /actions/{action}`.
ACTIONS = ("inspect", "burn_in", "provision", "release", "wipe", "reset", "reboot", "reflash")


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

    @model_validator(mode="after")
    def _something_to_run(self) -> Workload:
        if not self.command and self.image is None:
            raise ValueError("a workload names a command, an image, or both")
        return self


class WorkloadStatus(BaseModel):
    """What runs of the allocation's workload on a node, as its agent reports it."""

    state: Literal["none", "running", "exited", "stopped"]
    allocation_id: ShortId | None = None
    exit_code: int | None = Field(None, ge=-(2**31), lt=2**31)
    isolation: str | None = Field(
        None,
        max_length=32,
        description="pid-namespace, process-group where namespaces are refused, or container (podman or docker)",
    )


class ActionRequest(BaseModel):
    request_id: str = Field(min_length=1, max_length=300)
    tenant_id: ShortId | None = None
    # The allocation a provision is for: what the node's usage is metered against.
    allocation_id: str | None = Field(None, min_length=1, max_length=200)
    # A wipe's next agent credential (`gpa_<node id>.<secret>`): the agent reports with it once
    # the wipe succeeded; the control plane then revokes the old one.
    credential: str | None = Field(None, min_length=1, max_length=300)
    # What a provision starts on the node (None: the node is handed over with nothing running).
    workload: Workload | None = None
