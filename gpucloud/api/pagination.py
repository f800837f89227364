"""Keyset pagination with opaque cursors (AIP-158): no skipped or repeated rows.

A page is "rows with key > the last key seen, ordered by key, limit N+1". The key only grows
(an integer sequence, or a node id), so rows created during a listing never shift earlier rows
between pages. The token also carries a fingerprint of the query's filters: a token replayed
against other filters is refused instead of silently returning the wrong rows.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import Annotated, Any

from fastapi import Query
from sqlmodel import Session, SQLModel, select

from gpucloud.web.problems import Problem

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000

PageSize = Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE, description="rows per page")]
PageToken = Annotated[str | None, Query(description="the previous page's next_page_token")]


@dataclass(frozen=True)
class Cursor:
    after: int | str | None


def fingerprint(filters: dict) -> str:
    return hashlib.sha256(json.dumps(filters, sort_keys=True, default=str).encode()).hexdigest()[:16]


def encode(after: int | str, filters: dict) -> str:
    raw = json.dumps({"a": after, "f": fingerprint(filters)}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode(token: str | None, filters: dict) -> Cursor:
    if not token:
        return Cursor(after=None)
    try:
        padded = token + "=" * (-len(token) % 4)
        data = json.loads(base64.urlsafe_b64decode(padded.encode()))
        after, fp = data["a"], data["f"]
        if not isinstance(after, (int, str)) or isinstance(after, bool):
            raise ValueError("bad key")
    except (ValueError, KeyError, TypeError) as exc:
        raise Problem(
            400,
            "invalid-page-token",
            "Invalid page token",
            "page_token is not a token this API issued; start again without it",
        ) from exc
    if fp != fingerprint(filters):
        raise Problem(
            400,
            "invalid-page-token",
            "Invalid page token",
            "page_token was issued for a different query (filters changed); start again without it",
        )
    return Cursor(after=after)


def page(rows: list, page_size: int, key_of, filters: dict) -> tuple[list, str]:
    """Split the N+1 rows fetched into the page and the next token ('' at the end)."""
    if len(rows) <= page_size:
        return rows, ""
    rows = rows[:page_size]
    return rows, encode(key_of(rows[-1]), filters)


def fetch(
    session: Session,
    table: type[SQLModel],
    key: str,
    *,
    page_size: int,
    page_token: str | None,
    equal: Mapping[str, Any],
) -> tuple[list[Any], str]:
    """One page of `table`'s rows in `key` order, and the next token. `equal` maps columns to
    the values they must have (None: any); the token is bound to them."""
    filters = dict(equal)
    cursor = decode(page_token, filters)
    column = getattr(table, key)
    query = select(table).order_by(column).limit(page_size + 1)
    for name, value in filters.items():
        if value is not None:
            query = query.where(getattr(table, name) == value)
    if cursor.after is not None:
        query = query.where(column > cursor.after)
    return page(list(session.exec(query).all()), page_size, attrgetter(key), filters)
