"""`gpucloud tenants | allocations | api-keys | operations` against a live API and worker: each
resource as a table and as JSON, creates that wait for their operation, and the exit codes
(3 not found, 4 conflict, 5 unavailable, 2 usage)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from typer.testing import CliRunner

from gpucloud.cli.main import app

pytestmark = [pytest.mark.integration, pytest.mark.one_database]


async def test_operators_and_tenants_manage_resources_from_the_cli(ready_fleet):
    h = await ready_fleet(nodes=2)
    operator = {
        "GPUCLOUD_API__PORT": str(h.settings.api.port),
        "GPUCLOUD_API__OPERATOR_TOKEN": h.settings.operator_token,
        "GPUCLOUD_DATA_DIR": str(h.settings.data_dir),
        "COLUMNS": "250",
    }
    runner = CliRunner()

    async def run(*args: str, code: int = 0, key: str | None = None) -> str:
        env = {**operator, **({"GPUCLOUD_API_KEY": key} if key else {})}
        # Off the event loop: the worker runs on it.
        result = await asyncio.to_thread(runner.invoke, app, list(args), env=env)
        assert result.exit_code == code, result.output
        return result.output

    created = json.loads(await run("tenants", "create", "acme", "--quota", "H100:us-east-1=16", "-o", "json"))
    assert created["status"] == "active" and created["operation"]["status"] == "succeeded"
    tenant_id, key = created["id"], created["api_key"]["key"]
    assert tenant_id in [t["id"] for t in json.loads(await run("tenants", "list", "-o", "json"))]
    shown = await run("tenants", "show", tenant_id)
    assert "acme" in shown and "H100" in shown and "16" in shown
    await run("tenants", "create", "acme", code=4)  # the name is taken: a conflict

    allocation = json.loads(
        await run(
            "allocations",
            "create",
            "--gpu-type",
            "H100",
            "--region",
            "us-east-1",
            "--nodes",
            "1",
            "-o",
            "json",
            key=key,
        )
    )
    assert allocation["status"] == "ready" and len(allocation["node_ids"]) == 1
    assert allocation["id"] in await run("allocations", "list", key=key)
    detail = json.loads(await run("allocations", "show", allocation["id"], "-o", "json", key=key))
    assert detail["allocation"]["id"] == allocation["id"]
    released = json.loads(await run("allocations", "cancel", allocation["id"], "--wait", "-o", "json", key=key))
    assert released["status"] == "released"
    await run("allocations", "show", "alloc-does-not-exist", code=3, key=key)

    keys = json.loads(await run("api-keys", "list", "-o", "json", key=key))
    assert [k["tenant_id"] for k in keys] == [tenant_id]
    rotated = json.loads(await run("api-keys", "rotate", keys[0]["id"], "--grace", "60", "-o", "json", key=key))
    assert rotated["replaces"] == keys[0]["id"] and rotated["key"].startswith("gpc_")
    await run("api-keys", "rotate", keys[0]["id"], "--grace", "0", code=4, key=key)  # already rotated
    extra = json.loads(await run("api-keys", "create", "--tenant", tenant_id, "-o", "json"))  # the operator
    revoked = json.loads(await run("api-keys", "revoke", extra["id"], "--tenant", tenant_id, "-o", "json"))
    assert revoked["revoked_at"] is not None
    assert len(json.loads(await run("api-keys", "list", "--tenant", tenant_id, "-o", "json"))) == 3

    op = json.loads(await run("operations", "show", created["operation"]["id"], "-o", "json"))
    assert (op["kind"], op["status"]) == ("create_tenant", "succeeded")
    assert created["operation"]["id"] in await run("operations", "show", created["operation"]["id"])

    offboarded = json.loads(await run("tenants", "offboard", tenant_id, "-o", "json"))
    assert offboarded["tenant"]["status"] == "offboarded" and offboarded["operation"]["status"] == "succeeded"
    await run("tenants", "list", "-o", "yaml", code=2)  # usage
    unreachable = {**operator, "GPUCLOUD_API__PORT": "1"}
    down = await asyncio.to_thread(runner.invoke, app, ["tenants", "list"], env=unreachable)
    assert down.exit_code == 5 and "is `gpucloud up` running?" in down.output


def test_the_first_api_key_is_printed_before_onboarding_ends(tmp_path, temporal_env):
    """No worker runs, so onboarding never finishes: the key is on stdout all the same, before
    the wait gives up (exit 5), as a table and as JSON."""
    from gpucloud.config import Settings
    from gpucloud.devstack.stack import free_port
    from support.stack import ApiThread

    settings = Settings(
        data_dir=tmp_path,
        temporal={"address": temporal_env.client.service_client.config.target_host, "task_queue": "tq-no-worker"},
        api={"port": free_port(), "operator_token": "test-operator-token"},
    )
    api = ApiThread(settings)
    env = {
        "GPUCLOUD_API__PORT": str(settings.api.port),
        "GPUCLOUD_API__OPERATOR_TOKEN": "test-operator-token",
        "GPUCLOUD_DATA_DIR": str(tmp_path),
        "COLUMNS": "250",
    }
    try:
        # Ready: its namespace has every search attribute (the readiness check), yet no worker.
        ready = httpx.get(f"{api.url}/readyz", timeout=10)
        assert ready.status_code == 200, ready.text
        shown = CliRunner().invoke(app, ["tenants", "create", "stuck", "--timeout", "1"], env=env)
        assert shown.exit_code == 5, shown.output
        assert "first API key (shown once): gpc_" in shown.stdout
        assert shown.stdout.index("gpc_") < shown.output.index("error")
        as_json = CliRunner().invoke(app, ["tenants", "create", "stuck-2", "--timeout", "1", "-o", "json"], env=env)
        assert as_json.exit_code == 5, as_json.output
        assert json.loads(as_json.stdout)["api_key"]["key"].startswith("gpc_")
    finally:
        api.stop()
