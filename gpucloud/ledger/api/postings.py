"""Double-entry postings, their reversal, and account balances."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, status

from gpucloud.ledger import postings
from gpucloud.ledger.api.deps import LedgerDep
from gpucloud.ledger.schemas import PAGE_SIZE_MAX, AccountBalance, PostingOut, PostingPage, ReversalIn

router = APIRouter(prefix="/v1", tags=["postings"])


@router.get("/postings", response_model=PostingPage)
def list_postings(
    ledger: LedgerDep,
    tenant_id: str,
    allocation_id: str | None = None,
    cursor: Annotated[str | None, Query(description="next_cursor of the previous page")] = None,
    page_size: Annotated[int, Query(ge=1, le=PAGE_SIZE_MAX)] = 50,
) -> PostingPage:
    after_id = postings.decode_cursor(cursor)
    with ledger.database.read() as connection:
        items = postings.list_postings(
            connection, tenant_id=tenant_id, allocation_id=allocation_id, after_id=after_id, page_size=page_size
        )
    next_cursor = postings.encode_cursor(items[-1].id) if len(items) == page_size else None
    return PostingPage(items=items, next_cursor=next_cursor)


@router.post("/postings/{posting_id:int}:reverse", response_model=PostingOut, status_code=status.HTTP_201_CREATED)
def reverse_posting(posting_id: int, reversal: ReversalIn, ledger: LedgerDep) -> PostingOut:
    """Book the mirror image of a usage posting; a posting can be reversed once (409 after)."""
    with ledger.database.write() as connection:
        reversal_id = postings.reverse_posting(connection, posting_id, reason=reversal.reason, now_ms=ledger.clock_ms())
        return postings.get_posting(connection, reversal_id)


@router.get("/accounts", response_model=list[AccountBalance])
def account_balances(ledger: LedgerDep, prefix: str = "") -> list[AccountBalance]:
    with ledger.database.read() as connection:
        return postings.account_balances(connection, prefix=prefix)
