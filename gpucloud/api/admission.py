"""Admission control: a bounded number of requests in flight, fair between callers, in lanes.

Every request except the open ones (health, the OpenAPI document) takes a slot in its lane once
the gate (`api/gate.py`) knows who calls, and before its body is read or any handler, dependency
or database session runs:

- `agents`: node agents' reports, so a fleet's heartbeats neither starve nor are starved by
  tenants (a node's credential, and the operator posting batched reports to `/v1/agents/...`);
- `operator`: the operator token, so an operator can always look at a loaded system;
- `tenants`: every tenant's API keys, whatever path they call.

A lane with no free slot makes the request wait at most `admission_wait_s`, then answers 503
`overloaded` with `Retry-After`: a client always gets an answer, in seconds. Within a lane no
caller may hold more than its share of the slots (`caller_share` of the tenants' lane for a
tenant, all of its API keys together; `node_share` of the agents' lane for a node): beyond it
the request is answered 429 `too-many-requests` with `Retry-After` at once, before it can queue
in front of others (the fairness of Kubernetes' API Priority and Fairness, in its simplest
form). So neither a second key nor a node's stalled requests take more than one share.

A refusal is sent from bytes built once per lane: no database, no thread, no JSON encoding and
no logging per refused request, so clients that resend at once without waiting cost the
capacity they are refused from as little as an HTTP round trip can.

The lanes together, with the gate's credential lookups, hold fewer slots than the worker
threads the server runs sync handlers and dependencies on (`THREADS`): a request that holds a
database connection can always finish, and release it, on a free thread. That is what rules out
the pool deadlock where every thread waits for a connection whose release needs a thread.
"""

from __future__ import annotations

import base64
import binascii

from starlette.types import ASGIApp, Receive, Scope, Send

from gpucloud.api.auth import Caller
from gpucloud.config import ApiSettings
from gpucloud.web import problems
from gpucloud.web.admission import Lane, admit

# `/metrics` checks its own token (the metrics or the operator token) and takes no lane.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"})
# The threads sync handlers and dependencies run on (AnyIO's limiter, set at start-up); the
# lanes' slots and the gate's credential lookups at once stay well below it.
THREADS = 64
CREDENTIAL_LOOKUPS = 8


class Admission:
    """The ASGI middleware, inside the gate (it reads the caller the gate found); the API's
    settings size the lanes (`api.tenant_slots`, `api.caller_share`, `api.node_share`, ...)."""

    def __init__(self, app: ASGIApp, *, settings: ApiSettings) -> None:
        slots = settings.tenant_slots + settings.operator_slots + settings.agent_slots
        if slots + CREDENTIAL_LOOKUPS >= THREADS:
            lookups = f"{CREDENTIAL_LOOKUPS} credential lookups"
            raise ValueError(f"the lanes' slots and {lookups} must stay below the {THREADS} worker threads")
        self.app = app
        self.wait_s = settings.admission_wait_s
        self.lanes = {
            "tenants": Lane("tenants", settings.tenant_slots, settings.caller_share),
            "operator": Lane("operator", settings.operator_slots),
            "agents": Lane("agents", settings.agent_slots, settings.node_share),
        }

    def lane_of(self, caller: Caller, path: str) -> Lane:
        if caller.role in ("agent", "enrollment") or (caller.is_operator and path.startswith("/v1/agents/")):
            return self.lanes["agents"]
        return self.lanes["operator" if caller.is_operator else "tenants"]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        caller: Caller = scope["state"]["caller"]
        await admit(self.lane_of(caller, scope["path"]), caller.id, self.wait_s, self.app, scope, receive, send)


def bearer_token(scope: Scope) -> str:
    """The bearer token of the request ('' without one); checked by the gate."""
    scheme, _, token = (problems.header(scope, b"authorization") or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def basic_credentials(scope: Scope) -> tuple[str, str] | None:
    """(user, password) of HTTP basic auth, else None: how a BMC fetching virtual media
    authenticates (Redfish InsertMedia's UserName and Password)."""
    scheme, _, encoded = (problems.header(scope, b"authorization") or "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, colon, password = base64.b64decode(encoded.strip(), validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return (user, password) if colon else None
