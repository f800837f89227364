"""Idempotency-Key handling for creates (Stripe's semantics, kept >= 24 h).

A key is bound to (caller, method, path, body hash). The first request claims the key with a
row insert (the unique constraint decides races); it runs and stores its response. A replay with
the same body gets that first response back; the same key with another body or endpoint is a
422; a replay that arrives while the first is still running waits for its answer. A 5xx is not
stored, so a client can retry it with the same key. A response that shows a secret once (a new
API key) is stored redacted: its replay says what was created, without the secret.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Annotated

import sqlalchemy as sa
from fastapi import Header, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sqlmodel import col, select

from gpucloud.db import session_scope
from gpucloud.models.tables import IdempotencyRecord, utcnow
from gpucloud.web.problems import Problem

RETENTION = timedelta(hours=24)
WAIT_FOR_FIRST_S = 30.0
MAX_KEY_LENGTH = 255


def body_hash(body: bytes) -> str:
    """Hash of the JSON body's content, so key order and whitespace do not matter."""
    try:
        canonical = json.dumps(json.loads(body or b"null"), sort_keys=True, separators=(",", ":")).encode()
    except ValueError:
        canonical = body
    return hashlib.sha256(canonical).hexdigest()


def _mismatch(record: IdempotencyRecord, method: str, path: str, digest: str) -> str | None:
    if (record.method, record.path) != (method, path):
        return f"it was first used for {record.method} {record.path}"
    if record.body_hash != digest:
        return "it was first used with a different request body"
    return None


def _claim(db_url: str, caller: str, key: str, method: str, path: str, digest: str) -> IdempotencyRecord | None:
    """Claim the key; None if we own it now, else the existing record."""
    now = utcnow()
    with session_scope(db_url) as session:
        existing = session.exec(
            select(IdempotencyRecord).where(col(IdempotencyRecord.caller) == caller, col(IdempotencyRecord.key) == key)
        ).first()
        if existing is not None and existing.expires_at > now:
            return existing
        if existing is not None:
            session.delete(existing)
            session.flush()
        try:
            with session.begin_nested():
                session.add(
                    IdempotencyRecord(
                        caller=caller,
                        key=key,
                        method=method,
                        path=path,
                        body_hash=digest,
                        created_at=now,
                        expires_at=now + RETENTION,
                    )
                )
        except sa.exc.IntegrityError:
            return session.exec(
                select(IdempotencyRecord).where(
                    col(IdempotencyRecord.caller) == caller, col(IdempotencyRecord.key) == key
                )
            ).one()
    return None


def _load(db_url: str, caller: str, key: str) -> IdempotencyRecord | None:
    with session_scope(db_url) as session:
        return session.exec(
            select(IdempotencyRecord).where(col(IdempotencyRecord.caller) == caller, col(IdempotencyRecord.key) == key)
        ).first()


def _finish(
    db_url: str, caller: str, key: str, response: Response | None, redact: Callable[[bytes], bytes] | None = None
) -> None:
    with session_scope(db_url) as session:
        record = session.exec(
            select(IdempotencyRecord).where(col(IdempotencyRecord.caller) == caller, col(IdempotencyRecord.key) == key)
        ).first()
        if record is None:
            return
        if response is None or response.status_code >= 500:
            session.delete(record)
        else:
            record.status_code = response.status_code
            body = bytes(response.body)
            record.response_body = (redact(body) if redact and response.status_code < 300 else body).decode()
            session.add(record)


def _replay(record: IdempotencyRecord) -> Response:
    return Response(
        record.response_body or "",
        status_code=record.status_code or 200,
        media_type="application/json",
        headers={"Idempotent-Replayed": "true"},
    )


async def run_idempotent(
    *,
    db_url: str,
    caller: str,
    key: str | None,
    method: str,
    path: str,
    body: bytes,
    handler: Callable[[], Awaitable[Response]],
    redact: Callable[[bytes], bytes] | None = None,
) -> Response:
    """Run `handler` once per key. `redact` turns a successful response body into the one kept
    for replays, for answers that carry a secret which must be shown only once."""
    if key is None:
        return await handler()
    if not key or len(key) > MAX_KEY_LENGTH:
        raise Problem(
            400,
            "invalid-idempotency-key",
            "Invalid Idempotency-Key",
            f"Idempotency-Key must be 1 to {MAX_KEY_LENGTH} characters",
        )
    digest = body_hash(body)
    existing = await run_in_threadpool(_claim, db_url, caller, key, method, path, digest)
    if existing is not None:
        return await _answer_replay(db_url, caller, key, existing, method, path, digest)
    try:
        response = await handler()
    except Problem as problem:
        # A 4xx is the answer for this key too: store it as the response.
        response = problem.response(path)
    except BaseException:
        await run_in_threadpool(_finish, db_url, caller, key, None)
        raise
    await run_in_threadpool(_finish, db_url, caller, key, response, redact)
    return response


IdempotencyKey = Annotated[str | None, Header(description="makes a create safe to retry (kept 24 h)")]


async def idempotent(
    request: Request,
    db_url: str,
    caller: str,
    key: str | None,
    handler: Callable[[], Awaitable[Response]],
    *,
    redact: Callable[[bytes], bytes] | None = None,
) -> Response:
    """`run_idempotent` for the request a route is serving."""
    return await run_idempotent(
        db_url=db_url,
        caller=caller,
        key=key,
        method=request.method,
        path=request.url.path,
        body=await request.body(),
        handler=handler,
        redact=redact,
    )


def accepted(body: BaseModel, location: str, status_code: int = 202) -> JSONResponse:
    """The answer to a create: the body, and where the new resource (or its operation) lives."""
    return JSONResponse(body.model_dump(mode="json"), status_code=status_code, headers={"Location": location})


async def _answer_replay(
    db_url: str, caller: str, key: str, record: IdempotencyRecord, method: str, path: str, digest: str
) -> Response:
    why = _mismatch(record, method, path, digest)
    if why:
        raise Problem(
            422,
            "idempotency-key-reused",
            "Idempotency-Key reused",
            f"Idempotency-Key {key!r} cannot be reused here: {why}; use a new key for a new request",
        )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_FOR_FIRST_S
    current: IdempotencyRecord | None = record
    while current is not None and current.status_code is None:
        if loop.time() > deadline:
            raise Problem(
                409,
                "idempotency-in-progress",
                "Request in progress",
                f"a request with Idempotency-Key {key!r} is still running; retry shortly",
            )
        await asyncio.sleep(0.05)
        current = await run_in_threadpool(_load, db_url, caller, key)
    if current is None:  # the first attempt failed with a 5xx and released the key: run again
        raise Problem(
            409,
            "idempotency-retry",
            "Retry the request",
            f"the first request with Idempotency-Key {key!r} failed; retry it",
        )
    return _replay(current)
