"""The real agent's HTTP API in tests, called as the control plane calls it (a token it signed
for the node)."""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi.testclient import TestClient

from gpucloud.agent.app import Agent, create_app
from gpucloud.web.service_tokens import Issuer, Verifier, agent_audience

CONTROL_PLANE = Issuer(Ed25519PrivateKey.generate())


def agent_test_client(agent: Agent, **kwargs) -> TestClient:
    """A client of `create_app(agent, **kwargs)` presenting the control plane's token."""
    client = TestClient(create_app(agent, control_plane=Verifier(CONTROL_PLANE.public_key), **kwargs))
    client.headers["Authorization"] = f"Bearer {CONTROL_PLANE.mint(agent_audience(agent.state.node_id))}"
    return client
