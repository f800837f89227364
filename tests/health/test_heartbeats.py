"""Agents' heartbeats: a report that changes nothing is not written until the stored one is
getting old, so a steady fleet costs the database a read per heartbeat, not a write; a report
that changes something (drift, a new boot) is written at once (SQLite, and Postgres)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlmodel import col, select

from gpucloud.db import session_scope
from gpucloud.models.tables import Node, NodeEnroll
from gpucloud.services import nodes as node_service
from gpucloud.services.fleet import record_heartbeats

pytestmark = pytest.mark.integration

REFRESH = timedelta(seconds=30)


def _seen(db_url: str) -> Node:
    with session_scope(db_url) as session:
        return session.exec(select(Node).where(col(Node.id) == "n1")).one()


def test_unchanged_heartbeats_are_written_only_when_the_stored_one_gets_old(db_url):
    with session_scope(db_url) as session:
        node_service.enroll_nodes(
            session,
            [
                NodeEnroll(
                    id="n1",
                    hostname="h1",
                    region="r1",
                    pod="p",
                    rack="r",
                    gpu_type="H100",
                    gpu_count=8,
                    agent_url="http://x",
                )
            ],
        )
    beat = {"node_id": "n1", "tenant_id": None, "workload_running": False, "boot_id": "b1"}
    with session_scope(db_url) as session:
        record_heartbeats(session, [beat], refresh_after=REFRESH)
    first = _seen(db_url).last_heartbeat_at
    assert first is not None

    with session_scope(db_url) as session:
        record_heartbeats(session, [beat], refresh_after=REFRESH)
    assert _seen(db_url).last_heartbeat_at == first  # nothing new: not written

    with session_scope(db_url) as session:
        record_heartbeats(session, [{**beat, "boot_id": "b2"}], refresh_after=REFRESH)
    rebooted = _seen(db_url)
    assert rebooted.observed["boot_id"] == "b2" and rebooted.last_heartbeat_at > first  # a change: written

    with session_scope(db_url) as session:  # the stored report grows old: the next one refreshes it
        node = session.exec(select(Node).where(col(Node.id) == "n1")).one()
        node.last_heartbeat_at = rebooted.last_heartbeat_at - REFRESH
        session.add(node)
    with session_scope(db_url) as session:
        record_heartbeats(session, [{**beat, "boot_id": "b2"}], refresh_after=REFRESH)
    assert _seen(db_url).last_heartbeat_at > rebooted.last_heartbeat_at - REFRESH
