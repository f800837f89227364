"""Scratch databases for tests: a uniquely named Postgres database beside the configured one,
dropped (with its open connections) when the test is done (`gpucloud.db.scratch_postgres`)."""

from gpucloud.db import scratch_postgres

__all__ = ["scratch_postgres"]
