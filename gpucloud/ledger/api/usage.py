"""Usage: batch ingest from the agents' shippers, totals, and flagged conflicts."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import ValidationError

from gpucloud.ledger import problems
from gpucloud.ledger.api.deps import LedgerContext, LedgerDep
from gpucloud.ledger.schemas import PAGE_SIZE_MAX, USAGE_BATCH, ConflictOut, UsageBatchResult, usage_batch_schema
from gpucloud.ledger.usage import list_conflicts, usage_summary
from gpucloud.models.billing_messages import UsageSummary
from gpucloud.web import metrics

router = APIRouter(prefix="/v1", tags=["usage"])


@router.post(
    "/usage:batch",
    response_model=UsageBatchResult,
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": usage_batch_schema()}}}
    },
)
async def ingest_usage(request: Request, ledger: LedgerDep) -> UsageBatchResult:
    """Record each sample once per (node_id, seq); answers per sample (see ``ingest.py``).

    A body that is not a batch at all is a 422 for the whole request; a sample that makes no
    sense is rejected on its own in ``rejections`` while the rest of the batch is recorded.
    """
    body = await request.body()
    claims = request.scope.get("state", {}).get("claims")
    node = claims.subject.removeprefix("node:") if claims is not None and claims.role == "agent" else None
    # One thread validates and ingests every batch, one after the other. Batches are written
    # one at a time anyway (single writer); letting several threads take turns would make the
    # GIL bounce between them at each of SQLite's 8,000 row steps and halve throughput.
    return await asyncio.get_running_loop().run_in_executor(
        ledger.ingest_worker, _validate_and_ingest, ledger, body, node
    )


def _validate_and_ingest(ledger: LedgerContext, body: bytes, node: str | None) -> UsageBatchResult:
    """`node`: the agent's own node, the only one its samples may name (None: an operator's batch)."""
    # Validated straight from bytes into dicts: no model object per sample.
    try:
        batch = USAGE_BATCH.validate_json(body)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise problems.LedgerProblem(problems.REQUEST_INVALID(f"{field}: {first['msg']}", field=field)) from None
    foreign = sorted({s["node_id"] for s in batch["samples"]} - {node}) if node is not None else []
    if foreign:
        raise problems.LedgerProblem(
            problems.FORBIDDEN(f"the agent of {node} reports usage for its own node only, not {foreign[0]}")
        )
    result = ledger.ingest.ingest(batch["samples"])
    for outcome in ("accepted", "duplicates", "rejected"):
        metrics.LEDGER_SAMPLES.labels(outcome).inc(getattr(result, outcome))
    if result.rejections:
        ledger.rejections.record(batch["samples"], result.rejections)
    return result


@router.get("/usage", response_model=UsageSummary)
def get_usage(
    ledger: LedgerDep,
    tenant_id: str,
    allocation_id: str | None = None,
    start: Annotated[int | None, Query(ge=0, description="epoch ms, inclusive, by sample start")] = None,
    end: Annotated[int | None, Query(ge=0, description="epoch ms, exclusive, by sample start")] = None,
) -> UsageSummary:
    with ledger.database.read() as connection:
        return usage_summary(connection, tenant_id=tenant_id, allocation_id=allocation_id, start_ms=start, end_ms=end)


@router.get("/usage/conflicts", response_model=list[ConflictOut])
def get_conflicts(
    ledger: LedgerDep,
    node_id: str | None = None,
    after_id: Annotated[int, Query(ge=0)] = 0,
    page_size: Annotated[int, Query(ge=1, le=PAGE_SIZE_MAX)] = 50,
) -> list[ConflictOut]:
    with ledger.database.read() as connection:
        return list_conflicts(connection, node_id=node_id, after_id=after_id, page_size=page_size)
