"""Issue 37, items 2 and 5: every server checks who calls, then bounds the body, then the time it
takes to arrive, before anything parses it.

Every route of every server (the servers and the route walk of
`test_no_server_answers_without_credentials.py`, `support/servers.py`) is called in-process,
straight through ASGI, with a `receive` that counts the body bytes the server pulls:

- no credentials, a malformed body: 401 (not 422: the body was not judged);
- no credentials, 64 MiB declared by Content-Length: 401, and not one byte pulled;
- valid credentials, a body past the limit: 413, unread when declared, cut off at the limit
  when it streams without a Content-Length;
- valid credentials, half a body and then nothing: 408 within the read deadline from every
  route that reads a body (and no route waits on one past it).

Before: the tracker decoded any body before checking the token (422 without one), the ledger
read a usage batch of any size with a node's token, and no server bounded the time a body took
(uvicorn has none), so a stalled body held its admission slot for as long as the socket stayed
open. The last test does it over a real socket against uvicorn: the stalled client gets 408, its
connection is closed, and the server's slot is free again."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gpucloud.api.gate import ENROLLMENT_PATHS
from gpucloud.config import RequestBodySettings
from gpucloud.db import session_scope
from gpucloud.ledger.api.callers import allowed_roles
from gpucloud.ledger.app import create_app as ledger_app
from gpucloud.services.agent_enrollment import EnrollmentTokens
from gpucloud.web.service_tokens import (
    LEDGER_AUDIENCE,
    SWARM_MEMBER,
    SWARM_PEER,
    TRACKER_AUDIENCE,
    Issuer,
    Verifier,
    agent_audience,
    load_or_create_issuer,
    swarm_audience,
)
from gpucloud.web.serving import ThreadedServer
from support.servers import (
    FABRIC_TOKENS,
    OPERATOR_TOKEN,
    PEER_TENANT,
    calls,
    console_door,
    console_page,
    node_of,
    servers,
)

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

LIMIT = 256 * 1024
DEADLINE_S = 0.1
# A deadline that a steady pace does not extend: half a body buys no more time.
BODIES = RequestBodySettings(max_bytes=LIMIT, read_deadline_s=DEADLINE_S, min_bytes_per_s=1 << 40)
HUGE = 64 * 1024 * 1024
SWARM = "made-up-swarm"


@pytest.fixture
def issuer(tmp_path) -> Issuer:
    return load_or_create_issuer(tmp_path / "issuer_key.pem")


# A re-imaged node's one-time enrollment token: the only credential of the enrollment paths.
_ENROLLMENT = EnrollmentTokens("gate-test secret", ttl_s=3600)
ENROLLMENT_TOKEN = _ENROLLMENT.token("n-1", "gate-test")


@pytest.fixture
def apps(tmp_path, db_url, issuer, temporal_env) -> dict[str, FastAPI]:
    with session_scope(db_url) as session:
        _ENROLLMENT.hand_out(session, "n-1", "gate-test")
    return servers(tmp_path, db_url, Verifier(issuer.public_key), temporal_env.client, BODIES)


def _authorized(issuer: Issuer, server: str, method: str, path: str) -> tuple[str, dict[str, str]]:
    """The path (with any query its check reads) and headers a caller allowed on it sends."""

    def bearer(token: str) -> dict[str, str]:
        return {"authorization": f"Bearer {token}"}

    def swarm_token(swarm: str, role: str = SWARM_MEMBER) -> dict[str, str]:
        return bearer(issuer.mint(swarm_audience(swarm), subject="node:n-1", role=role, tenant=PEER_TENANT))

    parts = path.split("/")
    if server == "API" and path in ENROLLMENT_PATHS:
        return path, bearer(ENROLLMENT_TOKEN)
    if server == "API":
        return path, bearer(OPERATOR_TOKEN)
    if server == "simulated fabric managers":
        owner = {"ufmRest": FABRIC_TOKENS.ufm, "nmx": FABRIC_TOKENS.nmx, "sdn": FABRIC_TOKENS.sdn}
        return path, bearer(owner.get(parts[1], FABRIC_TOKENS.ufm))
    if server == "ledger":
        roles = allowed_roles(method, path)
        role = next(r for r in ("operator", "control-plane", "agent") if r in roles)
        return path, bearer(issuer.mint(LEDGER_AUDIENCE, role=role, subject="node:n-1"))
    if server == "peer" or ("/chunks/" in path and server in ("simulated fleet", "agent")):
        return f"{path}?swarm={SWARM}", swarm_token(SWARM, SWARM_PEER)  # peers take the peer token only
    if server == "agent":
        return path, bearer(issuer.mint(agent_audience("n-1")))
    if path.startswith("/origin/chunks/"):
        return f"{path}?swarm={SWARM}", swarm_token(SWARM)
    if server == "tracker":
        within_swarm = path.startswith("/tracker/swarms/") and len(parts) > 4
        return path, swarm_token(parts[3]) if within_swarm else bearer(issuer.mint(TRACKER_AUDIENCE))
    if (
        server == "simulated fleet"
        and path.startswith("/v1/nodes/")
        and parts[4:5]
        in (
            ["actions"],
            ["weights"],
            ["workload"],
        )
    ):
        return path, bearer(issuer.mint(agent_audience(parts[3])))
    if path == "/v1/bmc/notify":
        return f"{path}?token={OPERATOR_TOKEN}", {}
    return path, bearer(OPERATOR_TOKEN)


class Body:
    """A request body as the server's `receive` hands it out: `pieces`, then (with `stall`)
    nothing until the request is over. Counts the bytes the server pulled."""

    def __init__(self, pieces: list[bytes], *, stall: bool = False) -> None:
        self.pieces, self.stall = list(pieces), stall
        self.pulled = 0

    async def receive(self) -> dict:
        if self.pieces:
            piece = self.pieces.pop(0)
            self.pulled += len(piece)
            return {"type": "http.request", "body": piece, "more_body": bool(self.pieces) or self.stall}
        if self.stall:
            await asyncio.sleep(3600)
        return {"type": "http.disconnect"}


def _call(client: TestClient, method: str, path: str, headers: dict[str, str], body: Body) -> tuple[int, dict]:
    """One request straight through the app's ASGI interface, on the app's own event loop."""
    path, _, query = path.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(name.lower().encode(), value.encode()) for name, value in headers.items()],
        "client": ("127.0.0.1", 40000),
        "server": ("testserver", 80),
        "state": {},
    }
    answer: dict = {}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            answer.setdefault("status", message["status"])
            answer.setdefault("headers", {k.decode().lower(): v.decode() for k, v in message["headers"]})

    async def run() -> None:
        await client.app(scope, body.receive, send)

    client.portal.call(run)
    return answer["status"], answer["headers"]


def _walk(apps: dict[str, FastAPI], request: Callable[[TestClient, str, str, str], str | None]) -> dict[str, list]:
    """`request(client, server, method, path)` on every route of every server; what it found wrong."""
    wrong: dict[str, list] = {}
    for server, app in apps.items():
        with TestClient(app, raise_server_exceptions=False) as client:
            for method, path in calls(app, node_of(server)):
                if (problem := request(client, server, method, path)) is not None:
                    wrong.setdefault(server, []).append(f"{method} {path}: {problem}")
    return wrong


def test_a_stranger_gets_401_and_its_body_is_never_read(apps):
    def stranger(client: TestClient, server: str, method: str, path: str) -> str | None:
        if console_door(path):
            return None  # the console's sign-in form and static files: open (`support/servers.py`)
        # A console page sends a visitor to sign in (303); every other route refuses (401).
        refused = (303,) if console_page(path) else (401,)
        malformed = Body([b"{this is not json"])
        status, _ = _call(client, method, path, {"content-type": "application/json", "content-length": "17"}, malformed)
        if status not in refused or malformed.pulled:
            return f"malformed body -> {status}, {malformed.pulled} bytes pulled"
        huge = Body([b"x" * (1 << 20)] * 64)
        status, headers = _call(client, method, path, {"content-length": str(HUGE)}, huge)
        # `/metrics` checks the scraper's token in its route, behind the gate, and a console page
        # its session: the gate's 413 comes first.
        refused = (*refused, 413) if path == "/metrics" or console_page(path) else refused
        if status not in refused or huge.pulled or headers.get("connection") != "close":
            return f"64 MiB -> {status}, {huge.pulled} bytes pulled, connection {headers.get('connection')}"
        return None

    assert _walk(apps, stranger) == {}


def test_a_caller_gets_413_past_the_limit_declared_or_streamed(apps, issuer):
    def oversize(client: TestClient, server: str, method: str, path: str) -> str | None:
        path, headers = _authorized(issuer, server, method, path)
        declared = Body([b"x" * (1 << 20)] * 65)
        status, _ = _call(client, method, path, {**headers, "content-length": str(HUGE + 1)}, declared)
        if status != 413 or declared.pulled:
            return f"declared past the limit -> {status}, {declared.pulled} bytes pulled"
        streamed = Body([b" " * 65536] * 8)  # no Content-Length: counted as it arrives
        status, _ = _call(client, method, path, {**headers, "content-type": "application/json"}, streamed)
        if streamed.pulled > LIMIT + 65536 or (streamed.pulled and status not in (413, 411)):
            return f"streamed past the limit -> {status} after {streamed.pulled} bytes"
        return None

    assert _walk(apps, oversize) == {}


def test_a_body_that_stalls_is_answered_408_within_the_deadline(apps, issuer):
    timed_out: dict[str, list[str]] = {}

    def stalled(client: TestClient, server: str, method: str, path: str) -> str | None:
        path, headers = _authorized(issuer, server, method, path)
        half = Body([b'{"a": '], stall=True)
        began = time.monotonic()
        status, answer = _call(client, method, path, {**headers, "content-length": "1000"}, half)
        if status == 408:
            timed_out.setdefault(server, []).append(f"{method} {path}")
            if answer.get("connection") != "close" or time.monotonic() - began > DEADLINE_S + 5:
                return f"408 without closing, or {time.monotonic() - began:.1f} s late"
        elif half.pulled:  # the route took part of the body: only the deadline may answer then
            return f"read part of a stalled body and answered {status}"
        return None

    assert _walk(apps, stalled) == {}
    # Every server with a route that reads a body cut the stalled one off; the named cases too.
    assert set(timed_out) == {
        "API",
        "ledger",
        "agent",
        "tracker",
        "simulated fleet",
        "simulated fabric managers",
        "codec server",
    }
    assert "POST /v1/usage:batch" in timed_out["ledger"]
    assert "POST /tracker/swarms/made-up-swarm/plan" in timed_out["tracker"]
    assert "POST /actions/made-up-action" in timed_out["agent"]


def _stall(host: str, port: int, token: str, url: str, settle_s: float) -> tuple[bytes, float, bool]:
    """A usage batch stalled half sent while others ask; what the server answered it, when, and
    whether another caller was turned away (503) while it held its slot."""
    with socket.create_connection((host, port), timeout=10) as stalled:
        head = (
            f"POST /v1/usage:batch HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {token}\r\n"
            "content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
        )
        began = time.monotonic()
        stalled.sendall(head.encode() + b'{"samples": [' + b" " * 487)
        # The stalled request holds the slot once the server has read its head (on a loaded
        # machine that takes a moment, which the first poll leaves it): others get 503 meanwhile.
        time.sleep(settle_s)
        held_by = time.monotonic() + 2.5
        while not (held := httpx.get(f"{url}/healthz").status_code == 503) and time.monotonic() < held_by:
            time.sleep(0.05)
        answer = b""
        while chunk := stalled.recv(65536):  # until the server closes the connection
            answer += chunk
        return answer, time.monotonic() - began, held


def test_a_stalled_client_over_a_socket_gets_408_and_frees_its_slot(tmp_path, issuer):
    """uvicorn serving the ledger with room for one request at a time (limit_concurrency counts
    the connection asking): while a node's usage batch stalls half sent, other callers get 503;
    the deadline answers the stalled one 408 and closes its connection, and the next caller is
    served."""
    bodies = RequestBodySettings(read_deadline_s=3.0)
    verifier = Verifier(issuer.public_key)
    app = ledger_app(f"sqlite:///{tmp_path / 'ledger.db'}", control_plane=verifier, request_body=bodies)
    token = issuer.mint(LEDGER_AUDIENCE, role="agent", subject="node:n-1")
    with ThreadedServer(app, name="ledger", limit_concurrency=2) as server:
        host, port = httpx.URL(server.url).host, httpx.URL(server.url).port
        for settle_s in (0.3, 0.8, 1.5):
            answer, waited, held = _stall(host, port, token, server.url, settle_s)
            # On a loaded machine a poll's connection may reach the server before the stalled
            # request's head is read: the stalled one is then the one over the limit (503, as the
            # gate should answer), and the scenario is played again.
            if not answer.startswith(b"HTTP/1.1 503"):
                break
        assert held, "the stalled request never took the slot"
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"body-timeout" in answer and 2.9 < waited < 10, waited
        assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_the_api_document_declares_the_gates_answers(apps):
    responses = apps["API"].openapi()["paths"]["/v1/tenants"]["post"]["responses"]
    assert {"408", "413"} <= responses.keys()
    assert "408" not in apps["API"].openapi()["paths"]["/v1/tenants"]["get"]["responses"]
