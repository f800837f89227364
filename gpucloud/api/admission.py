"""Admission control: a bounded number of requests in flight, fair between callers, in lanes.

Every request except the open ones (health, the OpenAPI document) takes a slot in its lane
before any handler, dependency or database session runs:

- `agents`: node agents' reports (`/v1/agents/...`), so a fleet's heartbeats neither starve nor
  are starved by tenants;
- `operator`: the operator token, so an operator can always look at a loaded system;
- `tenants`: everyone else.

A lane with no free slot makes the request wait at most `admission_wait_s`, then answers 503
`overloaded` with `Retry-After`: a client always gets an answer, in seconds. Within the tenants'
lane no caller (one bearer token) may hold more than `caller_share` of the slots: beyond it the
request is answered 429 `too-many-requests` with `Retry-After` at once, before it can queue in
front of other tenants (the fairness of Kubernetes' API Priority and Fairness, in its simplest
form).

The lanes together hold fewer slots than the worker threads the server runs sync handlers and
dependencies on (`THREADS`): a request that holds a database connection can always finish, and
release it, on a free thread. That is what rules out the pool deadlock where every thread waits
for a connection whose release needs a thread.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from gpucloud.config import ApiSettings
from gpucloud.web import problems

# `/metrics` checks its own token (the metrics or the operator token) and takes no lane.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"})
# The threads sync handlers and dependencies run on (AnyIO's limiter, set at start-up); the
# lanes' slots stay well below it.
THREADS = 64


@dataclass
class Lane:
    name: str
    slots: int
    caller_share: float = 1.0
    _free: asyncio.Semaphore = field(init=False)
    _held: Counter[str] = field(init=False, default_factory=Counter)

    def __post_init__(self) -> None:
        self._free = asyncio.Semaphore(self.slots)

    @property
    def per_caller(self) -> int:
        return max(1, int(self.slots * self.caller_share))

    @property
    def in_flight(self) -> int:
        return sum(self._held.values())


# What a refused request is told to wait before it sends again.
RETRY_AFTER_S = 1


class Admission:
    """The ASGI middleware; the API's settings size the lanes (`api.tenant_slots`, `api.caller_share`, ...)."""

    def __init__(self, app: ASGIApp, *, operator_token: str, settings: ApiSettings) -> None:
        if settings.tenant_slots + settings.operator_slots + settings.agent_slots >= THREADS:
            raise ValueError(f"the lanes' slots must stay below the {THREADS} worker threads")
        self.app = app
        self.wait_s = settings.admission_wait_s
        self._operator = _caller_key(operator_token)
        self.lanes = {
            "tenants": Lane("tenants", settings.tenant_slots, settings.caller_share),
            "operator": Lane("operator", settings.operator_slots),
            "agents": Lane("agents", settings.agent_slots),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        caller = _caller_key(bearer_token(scope))
        if scope["path"].startswith("/v1/agents/"):
            lane = self.lanes["agents"]
        elif caller == self._operator:
            lane = self.lanes["operator"]
        else:
            lane = self.lanes["tenants"]
        if lane._held[caller] >= lane.per_caller:
            await self._refuse(scope, send, 429, "too-many-requests", "Too many requests", lane)
            return
        lane._held[caller] += 1
        try:
            try:
                await asyncio.wait_for(lane._free.acquire(), timeout=self.wait_s)
            except TimeoutError:
                await self._refuse(scope, send, 503, "overloaded", "Overloaded", lane)
                return
            try:
                await self.app(scope, receive, send)
            finally:
                lane._free.release()
        finally:
            lane._held[caller] -= 1
            if not lane._held[caller]:
                del lane._held[caller]

    async def _refuse(self, scope: Scope, send: Send, status: int, type_: str, title: str, lane: Lane) -> None:
        if status == 429:
            detail = f"this caller already has {lane.per_caller} requests in flight; retry after the Retry-After delay"
        else:
            detail = (
                f"all {lane.slots} request slots of the {lane.name} lane are busy; retry after the Retry-After delay"
            )
        document = problems.body(status, type_, title, detail, instance=scope["path"], retryable=True)
        await problems.send(scope, send, document, status, headers={"Retry-After": str(RETRY_AFTER_S)})


def bearer_token(scope: Scope) -> str:
    """The bearer token of the request ('' without one); checked later, by the routes' auth."""
    scheme, _, token = (problems.header(scope, b"authorization") or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _caller_key(token: str) -> str:
    """Callers told apart by their credential, without keeping it in memory in clear."""
    return hashlib.blake2b(token.encode(), digest_size=12).hexdigest()
