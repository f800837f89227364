"""A CLI command starts without loading what only the servers need: the workflow engine's SDK,
the web framework, migrations, the bootstrap and the database layer (SQLAlchemy, SQLModel and
the tables: 0.4 of the 0.85 CPU-s a command took to start) are imported by the commands that
use them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

SERVER_ONLY = (
    "temporalio",
    "fastapi",
    "alembic",
    "gpucloud.bootstrap",
    "gpucloud.api.schemas",
    "sqlalchemy",
    "sqlmodel",
    "gpucloud.models.tables",
    "gpucloud.models.registry_tables",
)


def test_the_cli_loads_no_server_module_before_a_command_runs() -> None:
    probe = f"import sys, json, gpucloud.cli.main; print(json.dumps([m for m in {SERVER_ONLY!r} if m in sys.modules]))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert json.loads(loaded.stdout) == []
