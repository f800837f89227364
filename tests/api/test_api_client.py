"""The public API's client: problem+json errors, which calls are retried, pagination, bounded waits."""

import httpx
import pytest

from gpucloud.client.base import ApiClient, ApiError, ApiTimeout

pytestmark = pytest.mark.unit


def client_over(handler) -> ApiClient:
    return ApiClient("http://api", "tok", retry_for_s=5, transport=httpx.MockTransport(handler))


def test_a_problem_becomes_an_api_error_naming_its_type():
    def handler(request):
        body = {"type": "https://gpucloud.dev/problems/quota-exceeded", "title": "Quota exceeded", "detail": "64 GPUs"}
        return httpx.Response(409, json=body)

    with client_over(handler) as api, pytest.raises(ApiError) as err:
        api.get("/v1/allocations")
    assert (err.value.status, err.value.type, err.value.detail) == (409, "quota-exceeded", "64 GPUs")


def test_reads_are_retried_after_a_503_with_retry_after():
    answers = [httpx.Response(503, json={"detail": "busy"}, headers={"Retry-After": "0"}), httpx.Response(200, json={})]
    calls = []

    def handler(request):
        calls.append(request.headers["authorization"])
        return answers.pop(0)

    with client_over(handler) as api:
        assert api.get("/v1/nodes") == {}
    assert calls == ["Bearer tok", "Bearer tok"]


def test_a_write_is_retried_only_under_an_idempotency_key():
    seen = []

    def handler(request):
        seen.append(request.headers.get("idempotency-key"))
        if len(seen) == 1:
            return httpx.Response(503, json={"detail": "busy"}, headers={"Retry-After": "0"})
        return httpx.Response(202, json={"id": "a"})

    with client_over(handler) as api:
        with pytest.raises(ApiError):
            api.call("POST", "/v1/allocations", json={})
        seen.clear()
        assert api.create("/v1/allocations", {"node_count": 1}) == {"id": "a"}
    assert len(seen) == 2 and seen[0] == seen[1] and seen[0]


def test_pages_follows_the_token_to_the_end():
    def handler(request):
        token = request.url.params.get("page_token")
        if token is None:
            return httpx.Response(200, json={"items": [1, 2], "next_page_token": "t"})
        return httpx.Response(200, json={"items": [3], "next_page_token": None})

    with client_over(handler) as api:
        assert list(api.pages("/v1/nodes")) == [1, 2, 3]


def test_wait_for_is_bounded():
    with (
        client_over(lambda request: httpx.Response(200, json={"status": "provisioning"})) as api,
        pytest.raises(ApiTimeout, match="allocation ready"),
    ):
        api.wait_for(
            lambda: api.get("/v1/allocations/a"),
            lambda a: a["status"] == "ready",
            timeout_s=0.2,
            interval_s=0.05,
            what="allocation ready",
        )
