"""Double-entry postings: every amount the ledger records moves between two accounts.

A usage posting debits ``tenant:<id>:receivable`` and credits ``revenue:gpu:<type>`` by the
same integer amount. A correction never edits one: it is a reversal posting with the lines
mirrored (credit receivable, debit revenue), linked to the posting it reverses; a posting can
be reversed once. Reversals land in the first open billing period at or after the original
one, like late usage.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, func, insert, select

from gpucloud.ledger import problems
from gpucloud.ledger.close import LineAggregate
from gpucloud.ledger.periods import next_period
from gpucloud.ledger.schemas import AccountBalance, EntryLineOut, PostingOut
from gpucloud.ledger.tables import billing_periods, entry_lines, postings


def receivable_account(tenant_id: str) -> str:
    return f"tenant:{tenant_id}:receivable"


def revenue_account(gpu_type: str) -> str:
    return f"revenue:gpu:{gpu_type}"


@dataclass(frozen=True, slots=True)
class Line:
    account: str
    side: str
    amount_micro: int


def usage_lines(tenant_id: str, gpu_type: str, amount_micro: int) -> tuple[Line, Line]:
    return (
        Line(receivable_account(tenant_id), "debit", amount_micro),
        Line(revenue_account(gpu_type), "credit", amount_micro),
    )


def mirrored(lines: Sequence[Line]) -> list[Line]:
    flip = {"debit": "credit", "credit": "debit"}
    return [Line(line.account, flip[line.side], line.amount_micro) for line in lines]


def check_balanced(lines: Sequence[Line]) -> None:
    debits = sum(line.amount_micro for line in lines if line.side == "debit")
    credits = sum(line.amount_micro for line in lines if line.side == "credit")
    if debits != credits or any(line.amount_micro < 0 for line in lines):
        raise problems.LedgerProblem(
            problems.INTEGRITY_FAILURE(f"posting does not balance: debits {debits}, credits {credits}")
        )


def insert_posting(connection: Connection, posting: dict, lines: Sequence[Line]) -> int:
    """Write one posting and its lines; refuses an unbalanced one."""
    check_balanced(lines)
    posting_id = connection.execute(insert(postings).returning(postings.c.id), posting).scalar_one()
    connection.execute(
        insert(entry_lines),
        [
            {"posting_id": posting_id, "account": line.account, "side": line.side, "amount_micro": line.amount_micro}
            for line in lines
        ],
    )
    return posting_id


def insert_held(connection: Connection, billing_period: str, line: LineAggregate, now_ms: int) -> int:
    """Post one line's true-up to held time (`held.py`) or a reservation's window
    (`reservations.py`): either sign, lines mirrored for a credit."""
    lines = usage_lines(line.tenant_id, line.gpu_type, abs(line.amount_micro))
    reserved = line.source == "reserved"
    posting = {
        "kind": "usage",
        "source": "reserved" if reserved else "held",
        "price_class": line.price_class,
        "billing_period": billing_period,
        "usage_period": line.usage_period,
        "tenant_id": line.tenant_id,
        "allocation_id": line.allocation_id,
        "gpu_type": line.gpu_type,
        "price_version_id": line.price_version_id,
        "gpu_ms": line.gpu_ms,
        "amount_micro": line.amount_micro,
        "sample_count": 0,
        "reverses_posting_id": None,
        "reason": "the capacity reservation's window, used or not"
        if reserved
        else "true-up to the time the allocation held (its events), against what its nodes metered",
        "created_ms": now_ms,
    }
    return insert_posting(connection, posting, lines if line.amount_micro >= 0 else mirrored(lines))


def closed_periods(connection: Connection) -> set[str]:
    return set(connection.execute(select(billing_periods.c.period_id)).scalars())


def first_open_period(period_id: str, closed: set[str]) -> str:
    """The period itself when open, else the next one after it that is still open."""
    while period_id in closed:
        period_id = next_period(period_id)
    return period_id


def reverse_posting(connection: Connection, posting_id: int, *, reason: str, now_ms: int) -> int:
    """Post the mirror image of a usage posting; call inside the ledger's write transaction."""
    original = connection.execute(select(postings).where(postings.c.id == posting_id)).mappings().first()
    if original is None:
        raise problems.LedgerProblem(problems.NOT_FOUND(f"posting {posting_id} does not exist"))
    if original["kind"] != "usage":
        raise problems.LedgerProblem(
            problems.STATE_CONFLICT(f"posting {posting_id} is a reversal; reverse usage postings only")
        )
    already = connection.execute(
        select(postings.c.id).where(postings.c.reverses_posting_id == posting_id)
    ).scalar_one_or_none()
    if already is not None:
        raise problems.LedgerProblem(
            problems.STATE_CONFLICT(f"posting {posting_id} was already reversed by posting {already}")
        )
    original_lines = [
        Line(row.account, row.side, row.amount_micro)
        for row in connection.execute(
            select(entry_lines.c.account, entry_lines.c.side, entry_lines.c.amount_micro)
            .where(entry_lines.c.posting_id == posting_id)
            .order_by(entry_lines.c.id)
        )
    ]
    reversal = {
        "kind": "reversal",
        "billing_period": first_open_period(original["billing_period"], closed_periods(connection)),
        "source": original["source"],
        "price_class": original["price_class"],
        "usage_period": original["usage_period"],
        "tenant_id": original["tenant_id"],
        "allocation_id": original["allocation_id"],
        "gpu_type": original["gpu_type"],
        "price_version_id": original["price_version_id"],
        "gpu_ms": -original["gpu_ms"],
        "amount_micro": -original["amount_micro"],
        "sample_count": original["sample_count"],
        "reverses_posting_id": posting_id,
        "reason": reason,
        "created_ms": now_ms,
    }
    return insert_posting(connection, reversal, mirrored(original_lines))


def encode_cursor(last_id: int) -> str:
    return base64.urlsafe_b64encode(f"posting:{last_id}".encode()).decode()


def decode_cursor(cursor: str | None) -> int:
    """The id a page starts after; cursors are opaque to clients."""
    if cursor is None:
        return 0
    try:
        kind, _, value = base64.urlsafe_b64decode(cursor.encode()).decode().partition(":")
        if kind == "posting" and value.isdigit():
            return int(value)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        pass
    raise problems.LedgerProblem(problems.REQUEST_INVALID("cursor is not one this ledger issued", field="cursor"))


def get_posting(connection: Connection, posting_id: int) -> PostingOut:
    row = connection.execute(select(postings).where(postings.c.id == posting_id)).mappings().one()
    page = list_postings(
        connection, tenant_id=row["tenant_id"], allocation_id=row["allocation_id"], after_id=posting_id - 1, page_size=1
    )
    return page[0]


def list_postings(
    connection: Connection,
    *,
    tenant_id: str,
    allocation_id: str | None,
    after_id: int,
    page_size: int,
) -> list[PostingOut]:
    """Postings of a tenant in id order, starting after ``after_id`` (keyset pagination)."""
    query = select(postings).where(postings.c.tenant_id == tenant_id, postings.c.id > after_id)
    if allocation_id is not None:
        query = query.where(postings.c.allocation_id == allocation_id)
    rows = connection.execute(query.order_by(postings.c.id).limit(page_size)).mappings().all()
    lines_by_posting: dict[int, list[EntryLineOut]] = {row["id"]: [] for row in rows}
    if rows:
        for line in connection.execute(
            select(entry_lines).where(entry_lines.c.posting_id.in_(list(lines_by_posting))).order_by(entry_lines.c.id)
        ).mappings():
            lines_by_posting[line["posting_id"]].append(
                EntryLineOut(account=line["account"], side=line["side"], amount_micro=line["amount_micro"])
            )
    return [PostingOut(**row, lines=lines_by_posting[row["id"]]) for row in rows]


def account_balances(connection: Connection, *, prefix: str) -> list[AccountBalance]:
    """Debits, credits and balance of every account whose name starts with ``prefix``."""
    debit = func.coalesce(func.sum(entry_lines.c.amount_micro).filter(entry_lines.c.side == "debit"), 0)
    credit = func.coalesce(func.sum(entry_lines.c.amount_micro).filter(entry_lines.c.side == "credit"), 0)
    query = (
        select(entry_lines.c.account, debit.label("debit"), credit.label("credit"))
        .where(entry_lines.c.account.startswith(prefix, autoescape=True))
        .group_by(entry_lines.c.account)
        .order_by(entry_lines.c.account)
    )
    return [
        AccountBalance(
            account=row.account,
            debit_micro=int(row.debit),
            credit_micro=int(row.credit),
            balance_micro=int(row.debit) - int(row.credit),
        )
        for row in connection.execute(query)
    ]
