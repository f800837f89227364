"""The `Idempotency-Key` header of a create is optional, and when it is sent it follows one rule.

Before: a key of spaces, or with a space inside, was taken as a key like any other, and the
document said neither that the header may be left out nor what a key may be. A create whose key
came out empty (a shell's `$(uuidgen)` on a machine without uuidgen) must be refused, not run
as a create that quietly is not idempotent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpucloud.api.app import create_app as api_app
from gpucloud.api.idempotency import KEY_PATTERN
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.services import tenants

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

A_UUID = "8f14e45f-ceea-467f-a0e6-8d2c1b3e9a70"  # fixed: xdist workers must collect the same ids


@pytest.fixture
def tenant_api(tmp_path: Path, db_url: str) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path, database={"url": db_url})
    with session_scope(db_url) as session:
        *_, key = tenants.create(session, name="first-day", quotas=[], actor="operator:test")
    app = api_app(settings, temporal=object())  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False, headers={"Authorization": f"Bearer {key}"}) as api:
        yield api


def _model_count(api: TestClient) -> int:
    return len(api.get("/v1/models").json()["items"])


def test_a_create_without_the_header_is_simply_not_idempotent(tenant_api: TestClient) -> None:
    first, second = (tenant_api.post("/v1/api-keys") for _ in range(2))
    assert first.status_code == second.status_code == 201
    assert first.json()["id"] != second.json()["id"]
    assert "idempotent-replayed" not in second.headers


@pytest.mark.parametrize("key", ["", " ", "two words", "tab\there", "x" * 256, "caf\xe9"])
def test_an_empty_or_malformed_key_is_a_400_naming_the_header_and_the_rule(tenant_api: TestClient, key: str) -> None:
    answer = tenant_api.post("/v1/models", json={"name": "refused"}, headers={"Idempotency-Key": key.encode("latin-1")})
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    problem = answer.json()
    assert problem["type"].endswith("/invalid-idempotency-key") and problem["header"] == "Idempotency-Key"
    assert "1 to 255 visible ASCII characters" in problem["detail"] and "leave the header out" in problem["detail"]
    assert _model_count(tenant_api) == 0  # refused before anything was created


@pytest.mark.parametrize("key", [A_UUID, "job-42:try_1.a", "01HZX3KQ9V/+=~!", "k" * 255])
def test_tokens_of_the_usual_shapes_are_keys(tenant_api: TestClient, key: str) -> None:
    first, replay = (tenant_api.post("/v1/api-keys", headers={"Idempotency-Key": key}) for _ in range(2))
    assert first.status_code == replay.status_code == 201, first.text
    assert replay.json()["id"] == first.json()["id"] and replay.headers["idempotent-replayed"] == "true"


def test_the_document_says_the_header_is_optional_what_it_does_and_its_rule(tenant_api: TestClient) -> None:
    document = tenant_api.get("/openapi.json").json()
    creates = [
        (path, operation)
        for path, operations in document["paths"].items()
        for operation in operations.values()
        if any(p["name"].lower() == "idempotency-key" for p in operation.get("parameters", []))
    ]
    assert len(creates) >= 8  # models, versions, evaluations, allocations, tenants, keys, operators, ...
    for path, operation in creates:
        header = next(p for p in operation["parameters"] if p["name"].lower() == "idempotency-key")
        assert header["in"] == "header" and header["required"] is False, path
        assert header["description"].startswith("Optional.") and "not idempotent" in header["description"]
        assert header["schema"]["pattern"] == KEY_PATTERN and header["schema"]["maxLength"] == 255
        assert "400" in operation["responses"], path
