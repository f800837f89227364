"""Operations: the status of a long-running mutation, backed by its workflow."""

from fastapi import APIRouter

from gpucloud.api.deps import CallerDep, ReadsDep, visible
from gpucloud.models.tables import Operation, OperationPublic

router = APIRouter(prefix="/v1", tags=["operations"])


@router.get("/operations/{operation_id}", response_model=OperationPublic)
def get_operation(operation_id: str, caller: CallerDep, reads: ReadsDep):
    with reads() as session:
        return visible(session, caller, Operation, "operation", operation_id)
