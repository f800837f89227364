"""Scratch databases for tests: a uniquely named Postgres database beside the configured one,
dropped (with its open connections) when the test is done."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import create_engine
from sqlalchemy.engine import make_url


@contextmanager
def scratch_postgres(base_url: str, prefix: str = "gpucloud_test") -> Iterator[str]:
    """A fresh database on the server of `base_url`; yields its URL, drops it on exit."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
        url = make_url(base_url).set(database=name).render_as_string(hide_password=False)
        try:
            yield url
        finally:
            from gpucloud.db import get_engine

            get_engine(url).dispose()  # the pooled connections the code under test left open
            with admin.connect() as connection:
                connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()
