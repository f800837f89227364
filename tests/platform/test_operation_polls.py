"""The harness's poll of an operation (`support.stack.settled_operation`) waits out an API that
answers 503 (its database did not answer in time) instead of taking the problem document's
`status` for the operation's end."""

from __future__ import annotations

import httpx
import pytest

from support.stack import settled_operation, wait_until

pytestmark = pytest.mark.unit


def test_a_503_is_asked_again_and_the_settled_operation_is_returned() -> None:
    answers = [
        httpx.Response(503, headers={"Retry-After": "1"}, json={"status": 503, "title": "Try again"}),
        httpx.Response(200, json={"id": "op_1", "status": "running"}),
        httpx.Response(200, json={"id": "op_1", "status": "succeeded"}),
    ]
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return answers.pop(0)

    with httpx.Client(base_url="http://api", transport=httpx.MockTransport(answer)) as client:
        final = wait_until(lambda: settled_operation(client, "op_1"), timeout_s=5, interval_s=0.01)
    assert final == {"id": "op_1", "status": "succeeded"}
    assert asked == ["/v1/operations/op_1"] * 3


def test_an_answer_that_is_not_the_operation_is_returned_for_the_test_to_see() -> None:
    gone = httpx.Response(404, json={"status": 404, "title": "Not found"})
    with httpx.Client(base_url="http://api", transport=httpx.MockTransport(lambda _: gone)) as client:
        assert settled_operation(client, "op_1") == {"status": 404, "title": "Not found"}
