"""Readers beside the writer: on SQLite (WAL), transactions that only read (credentials, a
heartbeat that changes nothing) get connections of their own and never queue behind the one
writer's transaction; they cannot write."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from gpucloud.db import read_scope, session_scope
from gpucloud.models.tables import Node
from gpucloud.services import fleet
from support.nodes import enroll

pytestmark = pytest.mark.integration


def _node(db_url: str) -> str:
    (node_id,) = enroll(db_url, ["rc-0"])
    return node_id


@contextlib.contextmanager
def _writer_held(db_url: str, update: sa.Update) -> Iterator[None]:
    """`update` run in a write transaction on another thread, held open (with the writer's one
    connection and SQLite's write lock) until the block ends, then committed."""
    holding, release = threading.Event(), threading.Event()

    def writer() -> None:
        with session_scope(db_url) as session:
            session.execute(update)
            holding.set()
            release.wait(15)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert holding.wait(10)
        yield
    finally:
        release.set()
        thread.join()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_read_does_not_wait_for_a_write_transaction_in_progress(db_url):
    node_id = _node(db_url)
    with _writer_held(db_url, sa.update(Node).where(Node.id == node_id).values(hostname="changed")):
        started = time.monotonic()
        with read_scope(db_url) as session:
            hostname = session.get(Node, node_id).hostname
        waited = time.monotonic() - started
    # The writer's one connection is held for seconds; a reader neither waits for it nor sees
    # what it has not committed.
    assert waited < 2.0
    assert hostname == "rc-0"
    with read_scope(db_url) as session:
        assert session.get(Node, node_id).hostname == "changed"


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_reader_cannot_write(db_url):
    node_id = _node(db_url)
    with pytest.raises(sa.exc.OperationalError, match="readonly"), read_scope(db_url) as session:
        session.execute(sa.update(Node).where(Node.id == node_id).values(hostname="nope"))


def test_a_heartbeat_that_changes_nothing_calls_for_no_write(db_url):
    node_id = _node(db_url)
    beat = {"node_id": node_id, "tenant_id": None, "workload_running": False, "boot_id": 1, "workload": None}
    with session_scope(db_url) as session:
        assert fleet.record_heartbeats(session, [beat]) == []
    with read_scope(db_url) as session:
        assert fleet.judge_heartbeats(session, [beat]) == ([], {})
        drifted, writes = fleet.judge_heartbeats(session, [{**beat, "boot_id": 2}])
    assert drifted == [] and set(writes) == {node_id}


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_a_read_on_postgres_is_one_statement_with_no_transaction_around_it(db_url):
    """Readers run in autocommit: no BEGIN before a read and no ROLLBACK after it (one round
    trip, not three). Each statement is its own transaction, so the second one's statement time
    is its transaction's start; inside a BEGIN it would be later."""
    with read_scope(db_url) as session:
        session.execute(sa.text("SELECT 1"))
        time.sleep(0.02)
        alone = session.execute(sa.text("SELECT statement_timestamp() = transaction_timestamp()")).scalar_one()
    assert alone is True


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_read_on_sqlite_is_one_statement_outside_any_transaction(db_url):
    """The same on SQLite: a reader's connection runs the read with no BEGIN sent before it, so
    SQLite holds no transaction open around it (each statement is its own)."""
    node_id = _node(db_url)
    from gpucloud.db import get_read_engine

    sent: list[str] = []

    def record(conn, cursor, statement, *args) -> None:
        sent.append(statement)

    engine = get_read_engine(db_url)
    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        with read_scope(db_url) as session:
            assert session.get(Node, node_id) is not None
            in_transaction = session.connection().connection.dbapi_connection.in_transaction
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    assert in_transaction is False
    assert [s.split()[0].upper() for s in sent] == ["SELECT"]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_the_apis_reads_answer_while_a_write_transaction_holds_the_writer(ready_fleet, db_url):
    """GETs read on readers' connections inside their own thread: while a write transaction
    holds SQLite's write lock and the one writer connection for seconds, they still answer at
    once and see what was committed before it."""
    h = await ready_fleet(nodes=1, latency_scale=0.02)
    tenant_id, key = await h.onboard()
    alloc_id = h.allocate(key, node_count=1)
    with _writer_held(db_url, sa.update(Node).values(hostname=Node.hostname)), h.client(key) as c:
        for path in (f"/v1/allocations/{alloc_id}", "/v1/allocations", f"/v1/tenants/{tenant_id}"):
            started = time.monotonic()
            answer = c.get(path)
            assert answer.status_code == 200, (path, answer.text)
            # On the writer's connection it would wait the pool's 10 s and answer 503.
            assert time.monotonic() - started < 5.0, path


def test_a_snapshot_read_sees_one_moment(db_url):
    """`read_scope(snapshot=True)`: a write committed between two of its statements is not seen
    by the second (figures that must add up); a plain read scope sees it."""
    node_id = _node(db_url)

    def rename(name: str) -> None:
        def write() -> None:
            with session_scope(db_url) as session:
                session.execute(sa.update(Node).where(Node.id == node_id).values(hostname=name))

        thread = threading.Thread(target=write)  # another connection, another thread
        thread.start()
        thread.join()

    query = sa.select(Node.hostname).where(Node.id == node_id)
    with read_scope(db_url, snapshot=True) as session:
        before = session.execute(query).scalar_one()
        rename("during-snapshot")
        assert session.execute(query).scalar_one() == before == "rc-0"
    with read_scope(db_url) as session:
        assert session.execute(query).scalar_one() == "during-snapshot"
        rename("during-plain")
        assert session.execute(query).scalar_one() == "during-plain"
