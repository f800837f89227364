"""Each domain error a service raises (`services/errors.py`) answers one problem document
(`api/errors.py`): its status, type, title, detail, members and, where it applies, Retry-After."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gpucloud.api import errors as api_errors
from gpucloud.services import errors
from gpucloud.web import problems

pytestmark = pytest.mark.unit

BASE = problems.TYPE_BASE

CASES = [
    (
        errors.NotFound("allocation", "alc_1"),
        404,
        {
            "type": BASE + "not-found",
            "title": "allocation not found",
            "detail": "no allocation 'alc_1' visible to this caller",
        },
        None,
    ),
    (
        errors.Forbidden("operators act for no tenant here", title="Tenant only"),
        403,
        {"type": BASE + "forbidden", "title": "Tenant only", "detail": "operators act for no tenant here"},
        None,
    ),
    (
        errors.Invalid("region", "no nodes in 'mars-1'", "not-offered", title="Unknown region"),
        422,
        {
            "type": BASE + "not-offered",
            "title": "Unknown region",
            "detail": "region: no nodes in 'mars-1'",
            "errors": [{"field": "region", "message": "no nodes in 'mars-1'"}],
        },
        None,
    ),
    (
        errors.Invalid("grace_period_s", "required"),
        422,
        {
            "type": BASE + "invalid-request",
            "title": "The request is invalid",
            "detail": "grace_period_s: required",
            "errors": [{"field": "grace_period_s", "message": "required"}],
        },
        None,
    ),
    (
        errors.Conflict("a tenant named 'acme' exists", type_="tenant-exists", title="Tenant exists", name="acme"),
        409,
        {
            "type": BASE + "tenant-exists",
            "title": "Tenant exists",
            "detail": "a tenant named 'acme' exists",
            "name": "acme",
        },
        None,
    ),
    (
        errors.QuotaExceeded("8 GPUs over", left_gpus=0),
        409,
        {"type": BASE + "quota-exceeded", "title": "Quota exceeded", "detail": "8 GPUs over", "left_gpus": 0},
        None,
    ),
    (
        errors.Unavailable("too many concurrent reservations; retry", type_="busy", title="Too much contention"),
        503,
        {"type": BASE + "busy", "title": "Too much contention", "detail": "too many concurrent reservations; retry"},
        None,
    ),
    (
        errors.Unavailable("the engine did not answer", type_="temporal-unavailable", retry_after_s=2, retryable=True),
        503,
        {
            "type": BASE + "temporal-unavailable",
            "title": "Try again",
            "detail": "the engine did not answer",
            "retryable": True,
        },
        "2",
    ),
    (
        errors.Broken(
            "the stored manifest fails its digest", type_="manifest-tampered", title="Stored manifest failed"
        ),
        500,
        {
            "type": BASE + "manifest-tampered",
            "title": "Stored manifest failed",
            "detail": "the stored manifest fails its digest",
        },
        None,
    ),
]


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    problems.install(app)
    api_errors.install(app)

    @app.get("/raise/{index}")
    def raise_(index: int) -> None:
        raise CASES[index][0]

    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[type(c[0]).__name__ for c in CASES])
def test_each_domain_error_answers_its_problem_document(client: TestClient, index: int) -> None:
    _, status, members, retry_after = CASES[index]
    answer = client.get(f"/raise/{index}")
    assert answer.status_code == status
    assert answer.headers["content-type"] == problems.MEDIA_TYPE
    assert answer.json() == {**members, "status": status, "instance": f"/raise/{index}"}
    assert answer.headers.get("retry-after") == retry_after


def test_the_same_error_answers_the_same_as_the_problem_a_router_raised_before() -> None:
    before = problems.not_found("node", "nod_1")
    after = api_errors.problem_for(errors.NotFound("node", "nod_1"))
    assert after.body("/v1/nodes/nod_1") == before.body("/v1/nodes/nod_1")
    assert (after.status, after.headers) == (before.status, before.headers)
    before = problems.unavailable("database", "send it again", retry_after_s=1)
    after = api_errors.problem_for(
        errors.Unavailable("send it again", type_="database-unavailable", retry_after_s=1, retryable=True)
    )
    assert after.body("/x") == before.body("/x") and after.headers == before.headers


def test_every_domain_error_has_a_status() -> None:
    kinds = {errors.NotFound, errors.Forbidden, errors.Conflict, errors.Invalid, errors.QuotaExceeded}
    kinds |= {errors.Unavailable, errors.Broken}
    assert {
        kind for kind in vars(errors).values() if isinstance(kind, type) and issubclass(kind, errors.DomainError)
    } == (kinds | {errors.DomainError})
    assert all(any(issubclass(kind, mapped) for mapped, _ in api_errors.STATUS) for kind in kinds)
