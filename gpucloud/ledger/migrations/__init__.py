"""Alembic migrations for the ledger database (run by ``gpucloud.ledger.db``)."""
