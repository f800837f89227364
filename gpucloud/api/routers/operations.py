"""Operations: the status of a long-running mutation, backed by its workflow."""

from fastapi import APIRouter
from sqlmodel import col, select

from gpucloud.api.deps import CallerDep, SessionDep
from gpucloud.models.tables import Operation, OperationPublic
from gpucloud.web.problems import not_found

router = APIRouter(prefix="/v1", tags=["operations"])


@router.get("/operations/{operation_id}", response_model=OperationPublic)
def get_operation(operation_id: str, caller: CallerDep, session: SessionDep):
    query = select(Operation).where(col(Operation.id) == operation_id)
    if not caller.is_operator:
        query = query.where(col(Operation.tenant_id) == caller.tenant_id)
    op = session.exec(query).first()
    if op is None:
        raise not_found("operation", operation_id)
    return op
