"""Operations (`GET /v1/operations/{id}`): the one way a running operation ends, and the record
of a change that ended within its request."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from sqlmodel import Session, col, select
from temporalio.service import RPCError

from gpucloud.db import Database
from gpucloud.models.tables import Operation, OperationStatus, utcnow
from gpucloud.services.workflow_engine import engine_error, waited_out


def record_done(
    session: Session, *, kind: str, resource_id: str, actor: str, tenant_id: str | None = None
) -> Operation:
    """A change made whole within its request (quotas replaced, an API key issued, a rollout
    paused), recorded as a settled operation so that who made it is kept like any operation's."""
    op = Operation(
        kind=kind, resource_id=resource_id, actor=actor, tenant_id=tenant_id, status=OperationStatus.SUCCEEDED
    )
    session.add(op)
    return op


def record_done_in(db: Database, *, kind: str, resource_id: str, actor: str, tenant_id: str | None = None) -> None:
    """`record_done` in a transaction of its own, for a change whose own state is not in the DB
    (a rollout's lives in its workflow, the registry's chunks in the object store)."""
    with db.session() as session:
        record_done(session, kind=kind, resource_id=resource_id, actor=actor, tenant_id=tenant_id)


def settle_operation(session: Session, operation_id: str, *, error: str | None) -> None:
    """Succeed the operation, or fail it with `error`; one already settled is left as it is."""
    op = session.exec(select(Operation).where(col(Operation.id) == operation_id)).first()
    if op is None or op.status != OperationStatus.RUNNING:
        return
    op.status = OperationStatus.FAILED if error else OperationStatus.SUCCEEDED
    op.error = error
    op.updated_at = utcnow()
    session.add(op)


def settle(db: Database, operation_id: str | None, *, error: str | None) -> None:
    """`settle_operation` in a transaction of its own (nothing to do without an operation)."""
    if operation_id is not None:
        with db.session() as session:
            settle_operation(session, operation_id, error=error)


async def start_for_operation(start: Awaitable[object], db: Database, operation_id: str, what: str) -> None:
    """Await the start of an operation's workflow; when the workflow engine does not take it, the
    operation fails (nothing will run it) and the caller gets 503 with Retry-After, or a 500
    naming the cause when no retry can help (`workflow_engine`)."""
    try:
        await start
    except RPCError as exc:
        why = "is unreachable" if waited_out(exc) else "refused it"
        await asyncio.to_thread(settle, db, operation_id, error=f"the workflow engine {why}: {exc}")
        raise engine_error(exc, what=what, left="its operation failed and nothing will run it") from exc
