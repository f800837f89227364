"""Every server the project runs, built in-process for the security tests, and every route of each.

`servers` builds the API, the ledger, a node's agent (with its weights and peer routes), the
tracker and origin, a node's peer service, the simulated fleet and fabric managers, and the codec
server, each as `gpucloud up` would (checking callers), with the request-body settings a test
gives. `calls` lists the requests that reach every route of one of them: every operation of its
OpenAPI document, every route it leaves out, and the weights and peer routes of the agent and of
the fleet's nodes (a mount)."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.routing import Mount
from temporalio.client import Client

from gpucloud.adapters.probe import detect_probe
from gpucloud.adapters.temporal import CodecKeys, EncryptionCodec, new_codec_key
from gpucloud.agent.app import Agent
from gpucloud.agent.app import create_app as agent_app
from gpucloud.agent.chunk_cache import ChunkCache
from gpucloud.agent.host import HostState
from gpucloud.agent.peer import create_peer_app
from gpucloud.agent.tenant_weights import TenantWeights
from gpucloud.agent.weights_api import always_healthy
from gpucloud.api.app import create_app as api_app
from gpucloud.config import RequestBodySettings, Settings
from gpucloud.console.session import PREFIX as CONSOLE
from gpucloud.console.session import is_console
from gpucloud.entrypoints.codec_server import create_app as codec_app
from gpucloud.entrypoints.tracker import create_tracker_app
from gpucloud.fabric.interface import FabricTokens
from gpucloud.ledger.app import create_app as ledger_app
from gpucloud.registry.manifest import Keyring
from gpucloud.registry.store import LocalChunkStore
from gpucloud.sim.fabric_managers import create_app as fabric_app
from gpucloud.sim.fleet import create_app as fleet_app
from gpucloud.sim.node_weights import WeightsSpec
from gpucloud.sim.nodes import FleetSpec
from gpucloud.sim.probe import SimulatedProbe
from gpucloud.web.service_tokens import Verifier

OPEN = {"/healthz", "/readyz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
# The web console (the API's `/console`) is a browser's: a session cookie, not a bearer token.
# Its door is open (the sign-in page and its form, the style sheet and scripts: `console/sign_in.py`);
# every other page sends a visitor without a session to the door (303), reading nothing it sent.
SIGN_IN = f"{CONSOLE}/sign-in"
CONSOLE_DOOR = (SIGN_IN, f"{CONSOLE}/static/")


def console_door(path: str) -> bool:
    return path.startswith(CONSOLE_DOOR)


def console_page(path: str) -> bool:
    """A page of the web console behind its sign-in (above)."""
    return is_console(path) and not console_door(path)


DIGEST = "0" * 64
OPERATOR_TOKEN = "operator-secret"
FABRIC_TOKENS = FabricTokens("ufm-secret", "nmx-secret", "sdn-secret")
PEER_TENANT = "t-1"


def node_of(server: str) -> str:
    """The node id a server's routes are called with (the simulated fleet names its own)."""
    return "n-00000" if server == "simulated fleet" else "n-1"


def servers(
    tmp_path: Path, db_url: str, verifier: Verifier, temporal: Client, request_body: RequestBodySettings
) -> dict[str, FastAPI]:
    body = request_body.model_dump()
    settings = Settings(
        data_dir=tmp_path,
        database={"url": db_url},
        api={"operator_token": OPERATOR_TOKEN, "max_body_bytes": request_body.max_bytes},
        request_body=body,
    )
    state = HostState(node_id="n-1", boot_id="boot", scratch_dir=tmp_path / "scratch", tenant_id=PEER_TENANT)
    agent = Agent(state, detect_probe("n-1", simulated=lambda: SimulatedProbe("n-1")))
    weights = TenantWeights(state, tmp_path / "agent-weights", verifier=verifier, health=always_healthy)
    cache = ChunkCache(tmp_path / "peer", keyring=Keyring(), tenant=PEER_TENANT)
    return {
        "API": api_app(settings, temporal=temporal),
        "ledger": ledger_app(f"sqlite:///{tmp_path / 'ledger.db'}", control_plane=verifier, request_body=request_body),
        "agent": agent_app(agent, control_plane=verifier, request_body=request_body, weights=weights),
        "tracker": create_tracker_app(
            tenant_chunks=lambda tenant: LocalChunkStore(tmp_path / "chunks" / tenant),
            verifier=verifier,
            request_body=request_body,
        ),
        "peer": create_peer_app(cache, verifier=verifier, request_body=request_body),
        "simulated fleet": fleet_app(
            FleetSpec(nodes=2, latency_scale=0, id_prefix="n"),
            base_url="http://127.0.0.1:1",
            control_plane=verifier,
            control_token=OPERATOR_TOKEN,
            weights=WeightsSpec(root=tmp_path / "sim-weights", keyring_for=lambda tenant: Keyring()),
            request_body=request_body,
        ),
        "simulated fabric managers": fabric_app(tokens=FABRIC_TOKENS, request_body=request_body),
        "codec server": codec_app(
            EncryptionCodec(CodecKeys.parse(new_codec_key())),
            database_url=db_url,
            operator_token=OPERATOR_TOKEN,
            request_body=request_body,
        ),
    }


def fill(path: str, node_id: str) -> str:
    """A concrete path: ids that look right (digests where a digest goes), the fleet's node."""

    def value(match: re.Match) -> str:
        name = match.group(1).split(":")[0]
        if name in ("chunk_id", "digest", "version"):
            return DIGEST
        if name == "node_id":
            return node_id
        return f"made-up-{name}"

    return re.sub(r"\{([^}]+)\}", value, path)


def calls(app: FastAPI, node_id: str) -> list[tuple[str, str]]:
    """(method, path) of every route but the open ones (module doc)."""
    found = {
        (method.upper(), fill(path, node_id))
        for path, operations in app.openapi()["paths"].items()
        for method in operations
        if method in ("get", "post", "put", "patch", "delete")
    }
    for route in app.routes:
        if isinstance(route, APIRoute):
            found |= {(method, fill(route.path, node_id)) for method in route.methods - {"HEAD"}}
        elif isinstance(route, Mount):
            base = fill(route.path, node_id)
            found |= {
                ("GET", f"{base}/weights/status"),
                ("POST", f"{base}/weights/prefetch"),
                ("POST", f"{base}/weights/activate"),
                ("GET", f"{base}/chunks/{DIGEST}"),
            }
    return sorted((method, path) for method, path in found if path not in OPEN)
