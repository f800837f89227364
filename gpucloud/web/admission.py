"""Admission's parts every server shares (`api/admission.py` documents the design): a lane of
slots with a share per caller, its refusals built once, and `admit`, which holds a slot around
one request or refuses it (429 over the caller's share at once, 503 after `wait_s` without a
free slot), before the body is read."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpucloud.web import problems
from gpucloud.web.gate import has_body

# What a refused request is told to wait before it sends again.
RETRY_AFTER_S = 1


@dataclass
class Lane:
    name: str
    slots: int
    caller_share: float = 1.0
    _free: asyncio.Semaphore = field(init=False)
    _held: Counter[str] = field(init=False, default_factory=Counter)
    # The two refusals' ASGI messages, built once, each also closing the connection (for a
    # request whose body is on its way: refused unread, as the gate refuses).
    _refusals: dict[tuple[int, bool], tuple[Message, Message]] = field(init=False)

    def __post_init__(self) -> None:
        self._free = asyncio.Semaphore(self.slots)
        whose = {"tenants": "tenant (all its API keys together)", "agents": "node"}.get(self.name, "caller")
        refusals = {
            429: (
                "too-many-requests",
                "Too many requests",
                f"this {whose} already has {self.per_caller} requests in flight; retry after the Retry-After delay",
            ),
            503: (
                "overloaded",
                "Overloaded",
                f"all {self.slots} request slots of the {self.name} lane are busy; retry after the Retry-After delay",
            ),
        }
        self._refusals = {
            (status, closing): _refusal(status, *refusal, closing=closing)
            for status, refusal in refusals.items()
            for closing in (False, True)
        }

    @property
    def per_caller(self) -> int:
        return max(1, int(self.slots * self.caller_share))

    @property
    def in_flight(self) -> int:
        return sum(self._held.values())

    async def refuse(self, scope: Scope, send: Send, status: int) -> None:
        start, body = self._refusals[status, has_body(scope)]
        await send(start)
        await send(body)


def _refusal(status: int, type_: str, title: str, detail: str, *, closing: bool) -> tuple[Message, Message]:
    content = json.dumps(problems.body(status, type_, title, detail, retryable=True)).encode()
    headers = [
        (b"content-type", problems.MEDIA_TYPE.encode()),
        (b"content-length", str(len(content)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
        *([(b"connection", b"close")] if closing else []),
    ]
    return (
        {"type": "http.response.start", "status": status, "headers": headers},
        {"type": "http.response.body", "body": content, "more_body": False},
    )


async def admit(lane: Lane, who: str, wait_s: float, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Run `app` for this request in one of `lane`'s slots, as caller `who`; or refuse it."""
    if lane._held[who] >= lane.per_caller:
        await lane.refuse(scope, send, 429)
        return
    lane._held[who] += 1
    try:
        try:
            await asyncio.wait_for(lane._free.acquire(), timeout=wait_s)
        except TimeoutError:
            await lane.refuse(scope, send, 503)
            return
        try:
            await app(scope, receive, send)
        finally:
            lane._free.release()
    finally:
        lane._held[who] -= 1
        if not lane._held[who]:
            del lane._held[who]
