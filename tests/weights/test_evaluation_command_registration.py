"""A model's evaluation command the platform is configured never to run is refused when it is
registered, naming why and what would be accepted.

Before: a command without an image was registered on a platform that runs tenants' commands only
in containers (`registry.evaluation_host_commands` off, the default), and the tenant learnt it
only from a failed evaluation, after pushing and asking for one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpucloud.api.app import create_app as api_app
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.services import tenants

pytestmark = pytest.mark.integration

HOST_COMMAND = {"argv": ["python", "eval.py"], "timeout_s": 60}
IMAGE_COMMAND = {**HOST_COMMAND, "image": "registry.example.com/eval:1"}


@pytest.fixture
def tenant_api(tmp_path: Path, db_url: str) -> Callable[..., AbstractContextManager[TestClient]]:
    @contextmanager
    def build(*, host_commands: bool) -> Iterator[TestClient]:
        settings = Settings(
            data_dir=tmp_path, database={"url": db_url}, registry={"evaluation_host_commands": host_commands}
        )
        with session_scope(db_url) as session:
            *_, key = tenants.create(session, name=f"evaluator-{host_commands}", quotas=[], actor="operator:test")
        app = api_app(settings, temporal=object())  # type: ignore[arg-type]
        with TestClient(app, raise_server_exceptions=False, headers={"Authorization": f"Bearer {key}"}) as api:
            yield api

    return build


def _refused(answer, field: str) -> None:
    assert answer.status_code == 422, answer.text
    problem = answer.json()
    assert problem["type"].endswith("/evaluation-command-not-runnable")
    assert problem["errors"][0]["field"] == field
    assert "registry.evaluation_host_commands is off" in problem["detail"] and "image" in problem["detail"]


def test_a_host_command_is_refused_at_registration_where_host_commands_are_off(tenant_api) -> None:
    with tenant_api(host_commands=False) as api:
        _refused(api.post("/v1/models", json={"name": "direct", "evaluation": HOST_COMMAND}), "evaluation.image")
        assert api.get("/v1/models/direct").status_code == 404  # nothing half-made
        assert api.post("/v1/models", json={"name": "scored"}).status_code == 201
        _refused(api.put("/v1/models/scored/evaluation", json=HOST_COMMAND), "image")
        assert api.get("/v1/models/scored").json()["evaluation"] is None
        # What the refusal says would be accepted is: the same command in an image.
        accepted = api.put("/v1/models/scored/evaluation", json=IMAGE_COMMAND)
        assert accepted.status_code == 200 and accepted.json()["evaluation"]["image"] == IMAGE_COMMAND["image"]
        created = api.post("/v1/models", json={"name": "boxed", "evaluation": IMAGE_COMMAND})
        assert created.status_code == 201, created.text


def test_a_host_command_is_registered_where_the_operator_allows_host_commands(tenant_api) -> None:
    with tenant_api(host_commands=True) as api:
        assert api.post("/v1/models", json={"name": "direct", "evaluation": HOST_COMMAND}).status_code == 201
        assert api.put("/v1/models/direct/evaluation", json=HOST_COMMAND).status_code == 200
