"""`gpucloud api-keys rotate` needs `--grace`: no default grace is safe (0 cuts off whatever still
holds the old key; any other keeps a leaked key alive), so the caller says which it means.

Before: leaving `--grace` out rotated with a grace of 0, and the old key died at once."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gpucloud.cli import resources as cli
from gpucloud.cli.main import app
from gpucloud.client.api import Gpucloud
from gpucloud.db import session_scope
from gpucloud.services import tenants
from support.operators import operator_api

pytestmark = pytest.mark.unit


def test_rotate_without_grace_is_a_usage_error_and_grace_0_ends_the_old_key_at_once(tmp_path, monkeypatch) -> None:
    with operator_api(tmp_path) as (client, settings):
        with session_scope(settings.database_url) as session:
            *_, key = tenants.create(session, name="rotator", quotas=[], actor="operator:test")
        key_id = key.removeprefix("gpc_").split(".")[0]

        def api_client(api_url=None, api_key=None, *, operator=False):
            return Gpucloud("http://testserver", api_key or key, transport=client._transport)

        monkeypatch.setattr(cli, "api_client", api_client)
        runner = CliRunner()
        unsaid = runner.invoke(app, ["api-keys", "rotate", key_id])
        assert unsaid.exit_code == 2 and "--grace SECONDS" in unsaid.output, unsaid.output
        assert client.get("/v1/api-keys", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        negative = runner.invoke(app, ["api-keys", "rotate", key_id, "--grace", "-1"])
        assert negative.exit_code == 2 and "--grace" in negative.output

        rotated = runner.invoke(app, ["api-keys", "rotate", key_id, "--grace", "0", "-o", "json"])
        assert rotated.exit_code == 0, rotated.output
        new = json.loads(rotated.output)
        assert new["replaces"] == key_id
        assert client.get("/v1/api-keys", headers={"Authorization": f"Bearer {key}"}).status_code == 401
        assert client.get("/v1/api-keys", headers={"Authorization": f"Bearer {new['key']}"}).status_code == 200
