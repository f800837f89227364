"""The read deadline of the gate every server has (`web/gate.py`): a large body that keeps
arriving at the minimum pace gets the time it needs, a trickle below it is cut off with 408,
and once the body is whole, `receive` is the server's own again (no deadline on waiting for the
client to go away)."""

from __future__ import annotations

import asyncio

import pytest

from gpucloud.config import RequestBodySettings
from gpucloud.web.gate import Gate

pytestmark = pytest.mark.unit

SETTINGS = RequestBodySettings(max_bytes=1 << 20, read_deadline_s=0.2, min_bytes_per_s=1000)


async def _allowed(scope) -> None:
    return None


async def _read_then_wait_for_disconnect(scope, receive, send) -> None:
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})
    await receive()  # as a streaming response listens for the client going away


def _serve(piece: bytes, pieces: int, every_s: float, *, linger_s: float = 0.0) -> tuple[int, float]:
    """The status a body of `pieces` pieces, one every `every_s`, gets; and how long it took."""

    async def run() -> tuple[int, float]:
        sent: list[int] = []
        left = pieces

        async def receive() -> dict:
            nonlocal left
            if left == 0:
                await asyncio.sleep(linger_s)
                return {"type": "http.disconnect"}
            await asyncio.sleep(every_s)
            left -= 1
            return {"type": "http.request", "body": piece, "more_body": left > 0}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                sent.append(message["status"])

        scope = {"type": "http", "method": "PUT", "path": "/x", "headers": [], "query_string": b""}
        began = asyncio.get_running_loop().time()
        await Gate(_read_then_wait_for_disconnect, check=_allowed, body=SETTINGS)(scope, receive, send)
        return sent[0], asyncio.get_running_loop().time() - began

    return asyncio.run(run())


def test_a_body_at_the_minimum_pace_takes_longer_than_the_deadline_and_passes():
    status, took = _serve(b"x" * 100, 10, 0.05)  # 2,000 bytes/s for 0.5 s
    assert status == 200 and took > SETTINGS.read_deadline_s


def test_a_trickle_below_the_minimum_pace_is_cut_off():
    status, took = _serve(b"x" * 5, 40, 0.05)  # 100 bytes/s
    assert status == 408 and took < 1.0


def test_once_the_body_is_whole_the_server_may_wait_on_receive_past_the_deadline():
    status, took = _serve(b"{}", 1, 0.0, linger_s=0.5)
    assert status == 200 and took >= 0.5
