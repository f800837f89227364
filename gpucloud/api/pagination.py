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
from dataclasses import dataclass

from gpucloud.web.problems import Problem

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000


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
