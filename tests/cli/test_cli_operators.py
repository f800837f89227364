"""`gpucloud operators create | list | rotate | revoke` against an in-process API: tables, JSON,
durations, and the token printed once."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gpucloud.cli import operators as cli
from gpucloud.cli.main import app
from gpucloud.client.api import Gpucloud
from support.operators import operator_api

pytestmark = pytest.mark.unit


def test_operators_commands_create_list_rotate_and_revoke(tmp_path, monkeypatch) -> None:
    with operator_api(tmp_path) as (client, settings):

        def api_client(api_url=None, api_key=None, *, operator=False):
            transport = client._transport  # the in-process app, as the CLI's client reaches it
            return Gpucloud("http://testserver", api_key or settings.operator_token, transport=transport)

        monkeypatch.setattr(cli, "api_client", api_client)
        runner = CliRunner()
        created = runner.invoke(
            app, ["operators", "create", "alice", "--role", "read-only", "--expires-in", "7d", "-o", "json"]
        )
        assert created.exit_code == 0, created.output
        issued = json.loads(created.output)
        assert issued["operator"]["role"] == "read-only" and issued["token"].startswith("gpo_")
        listed = runner.invoke(app, ["operators", "list"])
        assert listed.exit_code == 0 and "alice" in listed.output and "read-only" in listed.output
        # A read-only operator manages no operators: exit 1 and the scope it lacks.
        denied = runner.invoke(app, ["operators", "list", "--api-key", issued["token"]])
        assert denied.exit_code == 1 and "'operators'" in denied.output
        rotated = runner.invoke(app, ["operators", "rotate", "alice", "--grace", "1h"])
        assert rotated.exit_code == 0 and f"replaces {issued['token_id']}" in rotated.output
        bad = runner.invoke(app, ["operators", "rotate", "alice", "--grace", "soon"])
        assert bad.exit_code == 2 and "--grace" in bad.output
        revoked = runner.invoke(app, ["operators", "revoke", "alice", "-o", "json"])
        assert revoked.exit_code == 0 and json.loads(revoked.output)["revoked_at"] is not None
        assert runner.invoke(app, ["operators", "create", "bob", "--role", "root"]).exit_code == 2
