"""An ASGI app whose requests stay in flight until the test lets them go: what admission tests
put behind the middleware to hold slots."""

from __future__ import annotations

import asyncio


class Held:
    def __init__(self) -> None:
        self.in_flight = 0
        self.go, self.arrived = asyncio.Event(), asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        self.in_flight += 1
        self.arrived.set()
        await self.go.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def until(self, n: int) -> None:
        """Wait (at most 5 s) until `n` requests are in flight."""
        async with asyncio.timeout(5):
            while self.in_flight < n:
                self.arrived.clear()
                await self.arrived.wait()
