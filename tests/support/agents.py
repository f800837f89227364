"""The real agent's HTTP API in tests, called as the control plane calls it (a token it signed
for the node)."""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi.testclient import TestClient

from gpucloud.agent.app import Agent, create_app
from gpucloud.agent.tools import CommandResult, CommandRunner
from gpucloud.web.service_tokens import Issuer, Verifier, agent_audience

CONTROL_PLANE = Issuer(Ed25519PrivateKey.generate())
RESET_OK = (Path(__file__).parent.parent / "fixtures" / "tools" / "nvidia-smi-gpu-reset-ok.txt").read_text()


class GpuResetOnly(CommandRunner):
    """A node whose only hardware tool is `nvidia-smi`, which resets every GPU as its documentation
    shows: enough for a wipe without tenant disks (`agent/cleaning.py`), and nothing else."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, ...]] = []

    def which(self, tool: str) -> str | None:
        return "/usr/bin/nvidia-smi" if tool == "nvidia-smi" else None

    def run(self, argv: tuple[str, ...], timeout_s: float) -> CommandResult:
        assert argv == ("nvidia-smi", "--gpu-reset"), f"unexpected command line {argv}"
        self.ran.append(argv)
        return CommandResult(0, RESET_OK)


def agent_test_client(agent: Agent, **kwargs) -> TestClient:
    """A client of `create_app(agent, **kwargs)` presenting the control plane's token."""
    client = TestClient(create_app(agent, control_plane=Verifier(CONTROL_PLANE.public_key), **kwargs))
    client.headers["Authorization"] = f"Bearer {CONTROL_PLANE.mint(agent_audience(agent.state.node_id))}"
    return client
