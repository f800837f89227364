"""Keyset pagination with opaque cursors (AIP-158): no skipped or repeated rows.

A page is "rows with key > the last key seen, ordered by key, limit N+1". The key only grows
(an integer sequence, or a node id), so rows created during a listing never shift earlier rows
between pages. The token also carries a fingerprint of the query's filters: a token replayed
against other filters is refused instead of silently returning the wrong rows. Tokens are
signed (HMAC-SHA256 under the API's page-token secret, shared by its processes): a token the
API did not issue, or one whose key is of the wrong type or out of range, is a 400, never a
query.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import Annotated, Any

from fastapi import Depends, Query
from sqlmodel import Session, SQLModel, select

from gpucloud.web.problems import Problem

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000

PageSize = Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE, description="rows per page")]
PageToken = Annotated[str | None, Query(description="the previous page's next_page_token")]


@dataclass(frozen=True)
class PageRequest:
    """What a listing's caller asked for: rows per page, and where the last page ended."""

    size: int
    token: str | None


async def page_request(page_size: PageSize = DEFAULT_PAGE_SIZE, page_token: PageToken = None) -> PageRequest:
    return PageRequest(page_size, page_token)


# A listing's `page_size` and `page_token` query parameters, declared once for every route.
PageDep = Annotated[PageRequest, Depends(page_request)]


MAX_KEY = 2**63 - 1  # the largest integer key a database column holds
_secret = secrets.token_bytes(32)  # replaced by `use_secret` when the API starts


def use_secret(secret: str) -> None:
    """Sign and check tokens with `secret` (every API process of a deployment the same)."""
    global _secret
    _secret = hashlib.sha256(b"gpucloud page token\0" + secret.encode()).digest()


@dataclass(frozen=True)
class Cursor:
    after: int | str | None


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode((text + "=" * (-len(text) % 4)).encode())


def _mac(payload: bytes) -> bytes:
    return hmac.new(_secret, payload, hashlib.sha256).digest()[:16]


def _invalid(detail: str) -> Problem:
    return Problem(400, "invalid-page-token", "Invalid page token", detail)


def fingerprint(filters: dict) -> str:
    return hashlib.sha256(json.dumps(filters, sort_keys=True, default=str).encode()).hexdigest()[:16]


def encode(after: int | str, filters: dict) -> str:
    raw = json.dumps({"a": after, "f": fingerprint(filters)}, separators=(",", ":")).encode()
    return f"{_b64(raw)}.{_b64(_mac(raw))}"


def decode(token: str | None, filters: dict, key_type: type = int) -> Cursor:
    """The cursor a token carries; 400 for a token not signed here, for other filters, or with a
    key that is not a `key_type` in range."""
    if not token:
        return Cursor(after=None)
    foreign = _invalid("page_token is not a token this API issued; start again without it")
    try:
        body, _, mac = token.partition(".")
        raw = _unb64(body)
        if not hmac.compare_digest(_unb64(mac), _mac(raw)):
            raise foreign
        data = json.loads(raw)
        after: int | str = data["a"]
        fp = data["f"]
    except (ValueError, KeyError, TypeError) as exc:
        raise foreign from exc
    if type(after) is not key_type or (isinstance(after, int) and not 0 <= after <= MAX_KEY):
        raise foreign
    if fp != fingerprint(filters):
        raise _invalid("page_token was issued for a different query (filters changed); start again without it")
    return Cursor(after=after)


def page_of(rows: list, page_size: int, key_of, filters: dict) -> tuple[list, str]:
    """Split the N+1 rows fetched into the page and the next token ('' at the end)."""
    if len(rows) <= page_size:
        return rows, ""
    rows = rows[:page_size]
    return rows, encode(key_of(rows[-1]), filters)


def key_type(column: Any) -> type:
    """The Python type of a key column's values: int or str (a string column of a length that
    SQLAlchemy's type names no Python type for, `object`, holds str: `Node.id`)."""
    try:
        python_type = column.type.python_type
    except NotImplementedError:
        return str
    return python_type if python_type in (int, str) else str


def fetch(
    session: Session,
    table: type[SQLModel],
    key: str,
    *,
    page: PageRequest,
    equal: Mapping[str, Any],
    where: Mapping[str, tuple[Any, Any]] | None = None,
    newest_first: bool = False,
) -> tuple[list[Any], str]:
    """One page of `table`'s rows in `key` order, and the next token. `equal` maps columns to
    the values they must have (None: any); `where` maps a name to a value and the condition
    it stands for (one no column equality says: a link table's); the token is bound to both.
    `newest_first`: in descending `key` order (the console's lists), rows made during the
    listing come before its first page, so none is skipped or repeated either; the token is
    bound to the order too, so it never continues a listing in the other one."""
    extra = dict(where or {})
    filters = {**dict(equal), **{name: value for name, (value, _) in extra.items()}}
    if newest_first:
        filters["~order"] = "desc"
    column = getattr(table, key)
    cursor = decode(page.token, filters, key_type(column))
    query = select(table).order_by(column.desc() if newest_first else column).limit(page.size + 1)
    for name, value in equal.items():
        if value is not None:
            query = query.where(getattr(table, name) == value)
    for value, condition in extra.values():
        if value is not None:
            query = query.where(condition)
    if cursor.after is not None:
        query = query.where(column < cursor.after if newest_first else column > cursor.after)
    return page_of(list(session.exec(query).all()), page.size, attrgetter(key), filters)
