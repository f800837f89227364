"""Operations (`GET /v1/operations/{id}`): the one way a running operation ends."""

from __future__ import annotations

from sqlmodel import Session, col, select

from gpucloud.models.tables import Operation, OperationStatus, utcnow


def settle_operation(session: Session, operation_id: str, *, error: str | None) -> None:
    """Succeed the operation, or fail it with `error`; one already settled is left as it is."""
    op = session.exec(select(Operation).where(col(Operation.id) == operation_id)).first()
    if op is None or op.status != OperationStatus.RUNNING:
        return
    op.status = OperationStatus.FAILED if error else OperationStatus.SUCCEEDED
    op.error = error
    op.updated_at = utcnow()
    session.add(op)
