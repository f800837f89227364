"""Issue 13: no server of the stack answers a request without credentials, except `/healthz`,
`/readyz` and the OpenAPI document.

Every route of every server (the API, the ledger, a node's agent, the tracker and origin, a
node's peer service, the simulated fleet and the simulated fabric managers) is called as an
attacker on the network would: no `Authorization` header, a body that does not validate, made-up
ids. Each must answer 401, so a route added later without a check fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import Mount

from gpucloud.agent.app import Agent
from gpucloud.agent.app import create_app as agent_app
from gpucloud.agent.chunk_cache import ChunkCache
from gpucloud.agent.host import HostState
from gpucloud.agent.peer import create_peer_app
from gpucloud.api.app import create_app as api_app
from gpucloud.bootstrap import detect_probe
from gpucloud.config import Settings
from gpucloud.fabric.interface import FabricTokens
from gpucloud.ledger.app import create_app as ledger_app
from gpucloud.registry.manifest import Keyring
from gpucloud.registry.store import LocalChunkStore
from gpucloud.registry.tracker_app import create_tracker_app
from gpucloud.sim.fabric_managers import create_app as fabric_app
from gpucloud.sim.fleet import create_app as fleet_app
from gpucloud.sim.node_weights import WeightsSpec
from gpucloud.sim.nodes import FleetSpec
from gpucloud.web.service_tokens import Verifier, load_or_create_issuer

pytestmark = pytest.mark.one_database

OPEN = {"/healthz", "/readyz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
DIGEST = "0" * 64


def _fill(path: str, node_id: str) -> str:
    """A concrete path: ids that look right (digests where a digest goes), the fleet's node."""

    def value(match: re.Match) -> str:
        name = match.group(1).split(":")[0]
        if name in ("chunk_id", "digest", "version"):
            return DIGEST
        if name == "node_id":
            return node_id
        return f"made-up-{name}"

    return re.sub(r"\{([^}]+)\}", value, path)


def _calls(app: FastAPI, node_id: str) -> list[tuple[str, str]]:
    """Every operation of the OpenAPI document, every route it leaves out, and the fleet's
    per-node weights and peer routes (a mount)."""
    calls = {
        (method.upper(), _fill(path, node_id))
        for path, operations in app.openapi()["paths"].items()
        for method in operations
        if method in ("get", "post", "put", "patch", "delete")
    }
    for route in app.routes:
        if isinstance(route, APIRoute):
            calls |= {(method, _fill(route.path, node_id)) for method in route.methods - {"HEAD"}}
        elif isinstance(route, Mount):
            base = _fill(route.path, node_id)
            calls |= {
                ("GET", f"{base}/weights/status"),
                ("POST", f"{base}/weights/prefetch"),
                ("POST", f"{base}/weights/activate"),
                ("GET", f"{base}/chunks/{DIGEST}"),
            }
    return sorted(calls)


def _open_to_anyone(app: FastAPI, node_id: str = "n-1") -> list[str]:
    answered = []
    with TestClient(app, raise_server_exceptions=False) as client:
        for method, path in _calls(app, node_id):
            if path in OPEN:
                continue
            status = client.request(method, path, json={"garbage": True}).status_code
            if status != 401:
                answered.append(f"{method} {path} -> {status}")
    return answered


@pytest.fixture
def verifier(tmp_path) -> Verifier:
    return Verifier(load_or_create_issuer(tmp_path / "issuer_key.pem").public_key)


def _servers(tmp_path: Path, db_url: str, verifier: Verifier, temporal) -> dict[str, FastAPI]:
    settings = Settings(data_dir=tmp_path, database={"url": db_url})
    agent = Agent(HostState(node_id="n-1", boot_id="boot", scratch_dir=tmp_path / "scratch"), detect_probe("n-1"))
    cache = ChunkCache(tmp_path / "peer", keyring=Keyring(), tenant="t-1")
    return {
        "API": api_app(settings, temporal=temporal),
        "ledger": ledger_app(f"sqlite:///{tmp_path / 'ledger.db'}", control_plane=verifier),
        "agent": agent_app(agent, control_plane=verifier),
        "tracker": create_tracker_app(
            tenant_chunks=lambda tenant: LocalChunkStore(tmp_path / "chunks" / tenant), verifier=verifier
        ),
        "peer": create_peer_app(cache, verifier=verifier),
        "simulated fleet": fleet_app(
            FleetSpec(nodes=2, latency_scale=0, id_prefix="n"),
            base_url="http://127.0.0.1:1",
            control_plane=verifier,
            control_token="operator-secret",
            weights=WeightsSpec(root=tmp_path / "sim-weights", keyring_for=lambda tenant: Keyring()),
        ),
        "simulated fabric managers": fabric_app(tokens=FabricTokens("ufm-secret", "nmx-secret", "sdn-secret")),
    }


def test_every_route_of_every_server_needs_credentials(tmp_path, db_url, verifier, temporal_env):
    servers = _servers(tmp_path, db_url, verifier, temporal_env.client)
    found = {
        name: _open_to_anyone(app, "n-00000" if name == "simulated fleet" else "n-1") for name, app in servers.items()
    }
    assert {name: calls for name, calls in found.items() if calls} == {}
    # The scan reached every server's routes (a server with none checked would pass vacuously).
    checked = {name: len(_calls(app, "n-1")) for name, app in servers.items()}
    assert min(checked.values()) > 1, checked
    assert checked["API"] > 50 and checked["ledger"] > 10, checked


def test_health_and_the_openapi_document_stay_open(tmp_path, db_url, verifier, temporal_env):
    servers = _servers(tmp_path, db_url, verifier, temporal_env.client)
    with TestClient(servers["API"]) as api:
        assert api.get("/openapi.json").status_code == 200
    for name in ("tracker", "simulated fabric managers", "agent"):
        with TestClient(servers[name]) as client:
            assert client.get("/healthz").status_code == 200, name
