"""An operation whose workflow the engine does not take fails at once (nothing would ever run
it) and the caller gets 503 with Retry-After, or a 500 naming the cause when the engine refused
it for good; one it takes stays running."""

from __future__ import annotations

import asyncio

import pytest
from sqlmodel import col, select
from temporalio.service import RPCError, RPCStatusCode

from gpucloud.api.errors import problem_for
from gpucloud.db import Database, migrate, session_scope
from gpucloud.models.tables import Operation
from gpucloud.services.errors import DomainError
from gpucloud.services.operations import start_for_operation

pytestmark = pytest.mark.unit


def _operation(url: str) -> str:
    with session_scope(url) as session:
        op = Operation(kind="node_power_cycle", resource_id="n1", actor="operator:alice")
        session.add(op)
        session.flush()
        return op.id


def _status(url: str, operation_id: str) -> tuple[str, str | None]:
    with session_scope(url) as session:
        op = session.exec(select(Operation).where(col(Operation.id) == operation_id)).one()
        return op.status, op.error


def test_an_operation_the_engine_does_not_take_fails_with_a_503(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'cp.db'}"
    migrate(url)
    taken, refused = _operation(url), _operation(url)

    async def started() -> None:
        return None

    async def unreachable() -> None:
        raise RPCError("connection refused", RPCStatusCode.UNAVAILABLE, b"")

    asyncio.run(start_for_operation(started(), Database(url), taken, "the power action"))
    assert _status(url, taken) == ("running", None)
    with pytest.raises(DomainError) as raised:
        asyncio.run(start_for_operation(unreachable(), Database(url), refused, "the power action"))
    answer = problem_for(raised.value)
    assert answer.status == 503 and answer.headers["Retry-After"]
    assert "did not take the power action" in answer.detail
    status, error = _status(url, refused)
    assert status == "failed" and "workflow engine is unreachable" in (error or "")


def test_an_operation_the_engine_refuses_for_good_fails_with_a_500_naming_why(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'cp.db'}"
    migrate(url)
    refused = _operation(url)

    async def unprepared() -> None:
        raise RPCError("Namespace gpucloud is not found.", RPCStatusCode.NOT_FOUND, b"")

    with pytest.raises(DomainError) as raised:
        asyncio.run(start_for_operation(unprepared(), Database(url), refused, "the power action"))
    answer = problem_for(raised.value)
    assert answer.status == 500 and "Retry-After" not in answer.headers
    assert "refused the power action: Namespace gpucloud is not found" in answer.detail
    status, error = _status(url, refused)
    assert status == "failed" and "the workflow engine refused it: Namespace gpucloud is not found" in (error or "")
