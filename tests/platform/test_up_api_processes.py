"""How many API processes `gpucloud up` runs: two on Postgres unless `api.workers` says
otherwise, one on SQLite (one writer) unless set."""

from __future__ import annotations

import pytest

from gpucloud.config import Settings
from gpucloud.devstack.stack import api_processes

pytestmark = pytest.mark.unit

POSTGRES = {"url": "postgresql+psycopg://postgres@127.0.0.1:5432/test"}


def test_postgres_runs_two_api_processes_unless_told_how_many(tmp_path):
    assert api_processes(Settings(data_dir=tmp_path, database=POSTGRES)) == 2
    assert api_processes(Settings(data_dir=tmp_path, database=POSTGRES, api={"workers": 1})) == 1
    assert api_processes(Settings(data_dir=tmp_path, database=POSTGRES, api={"workers": 4})) == 4


def test_sqlite_runs_what_is_set_one_by_default(tmp_path):
    assert api_processes(Settings(data_dir=tmp_path)) == 1
    assert api_processes(Settings(data_dir=tmp_path, api={"workers": 0})) == 1
