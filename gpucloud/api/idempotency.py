"""Idempotency-Key handling for creates (Stripe's semantics, kept >= 24 h).

A key is bound to (caller, method, path, body hash). The first request claims the key with a
row insert (the unique constraint decides races); it runs and stores its response. A replay with
the same body gets that first response back; the same key with another body or endpoint is a
422; a replay that arrives while the first is still running waits for its answer. A 5xx is not
stored, so a client can retry it with the same key. A response that shows a secret once (a new
API key) is stored redacted: its replay says what was created, without the secret.

The header is optional: a create without it is simply not idempotent (every request creates).
A key, when given, is 1 to 255 visible ASCII characters (`KEY_RULE`: letters, digits and
punctuation, no spaces or control characters), which takes UUIDs, ULIDs, base64 and
`job-42:try-1` alike; anything else (an empty value among them) is a 400 naming the header and the
rule. A key the client meant to send but that came out empty (a shell substitution that printed
nothing) must not quietly turn a retried create into two.

A claim is a lease (`LEASE`), renewed while its request runs. A request that died with the
claim (its API process killed) lets the lease lapse: the next retry with the key takes the
claim over (compare-and-swap on the lease it saw) and runs the request again. A handler whose
work may have committed before the crash finds it by the key (an allocation records the key it
was created under), so the re-run answers with what exists instead of making it twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import Header, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sqlmodel import col, select

from gpucloud.api.errors import problem_for
from gpucloud.db import Database, rowcount
from gpucloud.models.tables import IdempotencyRecord, utcnow
from gpucloud.services.errors import DomainError
from gpucloud.web.problems import MEDIA_TYPE, Problem

log = logging.getLogger(__name__)

RETENTION = timedelta(hours=24)
LEASE = timedelta(seconds=6)
WAIT_FOR_FIRST_S = 30.0
MAX_KEY_LENGTH = 255
KEY_PATTERN = rf"^[\x21-\x7e]{{1,{MAX_KEY_LENGTH}}}$"
KEY_RULE = (
    f"1 to {MAX_KEY_LENGTH} visible ASCII characters (letters, digits and punctuation such as - _ . :; "
    "no spaces), e.g. a UUID"
)


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


def _lapsed(record: IdempotencyRecord, now: datetime) -> bool:
    """The request holding the claim stopped renewing it: it died without an answer."""
    if record.status_code is not None:
        return False
    return (record.lease_until or record.created_at + LEASE) < now


def _key_is(caller: str, key: str) -> Any:
    return sa.and_(col(IdempotencyRecord.caller) == caller, col(IdempotencyRecord.key) == key)


def _claim(db: Database, caller: str, key: str, method: str, path: str, digest: str) -> IdempotencyRecord | None:
    """Claim the key (or take over a claim whose lease lapsed); None if we own it now, else the
    existing record."""
    now = utcnow()
    with db.session() as session:
        existing = session.exec(select(IdempotencyRecord).where(_key_is(caller, key))).first()
        if existing is not None and existing.expires_at > now:
            if _lapsed(existing, now) and _mismatch(existing, method, path, digest) is None:
                seen = col(IdempotencyRecord.lease_until)
                taken = session.execute(
                    sa.update(IdempotencyRecord)
                    .where(
                        col(IdempotencyRecord.seq) == existing.seq,
                        col(IdempotencyRecord.status_code).is_(None),
                        seen.is_(None) if existing.lease_until is None else seen == existing.lease_until,
                    )
                    .values(lease_until=now + LEASE)
                )
                if rowcount(taken) == 1:
                    return None
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
                        lease_until=now + LEASE,
                    )
                )
        except sa.exc.IntegrityError:
            return session.exec(select(IdempotencyRecord).where(_key_is(caller, key))).one()
    return None


def _renew(db: Database, caller: str, key: str) -> None:
    with db.session() as session:
        session.execute(
            sa.update(IdempotencyRecord)
            .where(_key_is(caller, key), col(IdempotencyRecord.status_code).is_(None))
            .values(lease_until=utcnow() + LEASE)
        )


async def _keep_claim(db: Database, caller: str, key: str) -> None:
    """Renew the claim's lease while its request runs (a third of the lease apart)."""
    while True:
        await asyncio.sleep(LEASE.total_seconds() / 3)
        try:
            await run_in_threadpool(_renew, db, caller, key)
        except sa.exc.SQLAlchemyError as exc:  # the database is down: the lease may lapse
            log.warning("could not renew the claim on Idempotency-Key %r: %s", key, exc)


def _load(db: Database, caller: str, key: str) -> IdempotencyRecord | None:
    with db.session() as session:
        return session.exec(
            select(IdempotencyRecord).where(col(IdempotencyRecord.caller) == caller, col(IdempotencyRecord.key) == key)
        ).first()


def _finish(
    db: Database, caller: str, key: str, response: Response | None, redact: Callable[[bytes], bytes] | None = None
) -> None:
    with db.session() as session:
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
    status = record.status_code or 200
    return Response(
        record.response_body or "",
        status_code=status,
        # Every error this API answers is a problem document (kept only for 4xx: a 5xx is not kept).
        media_type=MEDIA_TYPE if status >= 400 else "application/json",
        headers={"Idempotent-Replayed": "true"},
    )


async def run_idempotent(
    *,
    db: Database,
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
    if re.fullmatch(KEY_PATTERN, key) is None:
        raise Problem(
            400,
            "invalid-idempotency-key",
            "Invalid Idempotency-Key",
            f"Idempotency-Key must be {KEY_RULE}; got {_shown(key)}. Send a valid key to make the create "
            "safe to retry, or leave the header out for a create that is not idempotent",
            header="Idempotency-Key",
        )
    digest = body_hash(body)
    existing = await run_in_threadpool(_claim, db, caller, key, method, path, digest)
    if existing is not None:
        answered = await _await_first(db, caller, key, existing, method, path, digest)
        if answered is not None:
            return _replay(answered)
        # The first request died with the claim, which is ours now: run it again.
    keeper = asyncio.create_task(_keep_claim(db, caller, key))
    try:
        response = await handler()
    except Problem as problem:
        # A 4xx is the answer for this key too: store it as the response.
        response = problem.response(path)
    except DomainError as error:
        response = problem_for(error).response(path)
    except BaseException:
        await run_in_threadpool(_finish, db, caller, key, None)
        raise
    finally:
        keeper.cancel()
    await run_in_threadpool(_finish, db, caller, key, response, redact)
    return response


def _shown(key: str) -> str:
    """The refused key as the detail quotes it: an empty one named as such, a long one cut short."""
    if not key:
        return "an empty value"
    return repr(key) if len(key) <= 40 else f"{key[:40]!r}... ({len(key)} characters)"


KEY_DESCRIPTION = (
    "Optional. Makes this create safe to retry: a request with the same key and the same body "
    "within 24 h answers the first request's response (with `Idempotent-Replayed: true`) instead "
    "of creating again; the same key with another body or endpoint is a 422. Leave it out and the "
    f"create is not idempotent: every request creates. A key is {KEY_RULE}; anything else, an empty "
    "value included, is a 400."
)

# The pattern is in the document (clients and schemathesis read it) but checked by
# `run_idempotent`, which answers a 400 naming the header rather than FastAPI's generic 422.
IdempotencyKey = Annotated[
    str | None,
    Header(description=KEY_DESCRIPTION, json_schema_extra={"pattern": KEY_PATTERN, "maxLength": MAX_KEY_LENGTH}),
]


async def idempotent(
    request: Request,
    database: Database,
    caller: str,
    key: str | None,
    handler: Callable[[], Awaitable[Response]],
    *,
    redact: Callable[[bytes], bytes] | None = None,
) -> Response:
    """`run_idempotent` for the request a route is serving, on the app's `database`."""
    return await run_idempotent(
        db=database,
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


async def _await_first(
    db: Database, caller: str, key: str, record: IdempotencyRecord, method: str, path: str, digest: str
) -> IdempotencyRecord | None:
    """The first request's stored answer, waited for while it runs; None when this request
    claimed the key instead (the first died: its lease lapsed, or it failed and let go)."""
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
    while current is None or current.status_code is None:
        if current is None or _lapsed(current, utcnow()):
            current = await run_in_threadpool(_claim, db, caller, key, method, path, digest)
            if current is None:
                return None
            continue
        if loop.time() > deadline:
            raise Problem(
                409,
                "idempotency-in-progress",
                "Request in progress",
                f"a request with Idempotency-Key {key!r} is still running; retry shortly",
                headers={"Retry-After": "1"},
            )
        await asyncio.sleep(0.05)
        current = await run_in_threadpool(_load, db, caller, key)
    return current
