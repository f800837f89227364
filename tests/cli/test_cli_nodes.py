"""`gpucloud nodes` renders the fleet as a table through the API."""

from __future__ import annotations

import json
import os

import pytest

from support.forked import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.one_database]


def test_nodes_table_filters_by_state(db_url, make_harness):
    h = make_harness(db_url, nodes=3)
    ids = h.enroll_fleet()  # no worker: the nodes stay enrolled
    env = {
        **os.environ,
        "GPUCLOUD_API__PORT": str(h.settings.api.port),
        "GPUCLOUD_API__OPERATOR_TOKEN": h.settings.operator_token,
        "COLUMNS": "200",
    }
    out = run_cli(["nodes", "--state", "enrolled"], env=env, cwd=h.log_dir)
    assert out.returncode == 0, out.stderr
    assert all(i in out.stdout for i in ids) and "nodes (3 shown of 3)" in out.stdout
    assert "enrolled: 3" in out.stdout
    none = run_cli(["nodes", "--state", "active"], env=env, cwd=h.log_dir)
    assert none.returncode == 0 and ids[0] not in none.stdout
    as_json = run_cli(["nodes", "--output", "json"], env=env, cwd=h.log_dir)
    listed = json.loads(as_json.stdout)
    assert sorted(n["id"] for n in listed["nodes"]) == sorted(ids) and listed["summary"]["total"] == 3
    down = run_cli(["nodes"], env={**env, "GPUCLOUD_API__PORT": "1"}, cwd=h.log_dir)
    assert down.returncode == 5 and "is `gpucloud up` running?" in down.stderr  # unavailable
