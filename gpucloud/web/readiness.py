"""`/readyz`: whether a server can do its work now, for load balancers and orchestrators.

`/healthz` says the process is alive (it answers whatever its dependencies do); `/readyz` runs
each of the server's checks at once, each bounded (`CHECK_TIMEOUT_S`), and answers 200 with
every check `ok`, or 503 problem+json (`not-ready`, with `Retry-After`) naming each dependency
that failed and why. Both are open (no credentials), like the OpenAPI document.

What a deployment prepares once (`gpucloud prepare`: the Temporal namespace and its search
attributes, the object store's bucket, the ledger's price book) is looked for until it is found
once, then taken as there: made, it stays, and every load balancer probes every few seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING

import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from gpucloud.web import problems

if TYPE_CHECKING:
    from gpucloud.storage.objects import ObjectStore
    from gpucloud.web.service_tokens import DelegateFile

CHECK_TIMEOUT_S = 3.0
RETRY_AFTER_S = 5

Check = Callable[[], Awaitable[None]]
"""Raises when the dependency cannot be used now."""


def database_check(engine: sa.Engine) -> Check:
    """The database answers a query (on a connection of its own pool)."""

    def query() -> None:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")

    async def check() -> None:
        await asyncio.to_thread(query)

    return check


def temporal_check(client: Callable[[], object]) -> Check:
    """The Temporal frontend answers its health check, and the client's namespace exists with
    every search attribute the workflows set (else starts fail however often they are retried).
    The namespace and its attributes are listed until they are found once: registered, they stay,
    and `/readyz` is probed every few seconds by every load balancer."""
    prepared = False

    async def check() -> None:
        nonlocal prepared
        from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
        from temporalio.service import RPCError, RPCStatusCode

        from gpucloud.models import search_attributes

        temporal = client()
        service = temporal.service_client  # type: ignore[attr-defined]
        if not await service.check_health(timeout=timedelta(seconds=CHECK_TIMEOUT_S)):
            raise RuntimeError("the frontend reports itself not serving")
        if prepared:
            return
        namespace = temporal.namespace  # type: ignore[attr-defined]
        try:
            listed = await service.operator_service.list_search_attributes(
                ListSearchAttributesRequest(namespace=namespace)
            )
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                raise RuntimeError(f"namespace {namespace} not found: run `gpucloud prepare`") from exc
            raise
        missing = sorted(key.name for key in search_attributes.ALL if key.name not in listed.custom_attributes)
        if missing:
            raise RuntimeError(f"search attributes {', '.join(missing)} missing in {namespace}: run `gpucloud prepare`")
        prepared = True

    return check


def object_store_check(store: ObjectStore) -> Check:
    """The object store exists: its bucket (S3) or its directory, else `StoreMissingError`
    naming it and `gpucloud prepare`. Asked until found once. A probe that outlives its
    `CHECK_TIMEOUT_S` (an S3 endpoint that does not answer, within boto3's own timeouts) goes
    on in its thread, and the next `/readyz` waits for that one instead of starting another,
    so a hung store holds one thread, not one per probe."""
    found = False
    probing: asyncio.Future[None] | None = None

    async def check() -> None:
        nonlocal found, probing
        if found:
            return
        if probing is None or probing.done():
            probing = asyncio.ensure_future(asyncio.to_thread(store.probe))
            # A probe that ends after its `/readyz` gave up: its error is taken here, not left
            # to be reported as never retrieved (the next probe asks again anyway).
            probing.add_done_callback(lambda done: done.cancelled() or done.exception())
        await asyncio.shield(probing)
        found = True

    return check


async def _run(check: Check) -> str:
    try:
        await asyncio.wait_for(check(), CHECK_TIMEOUT_S)
    except TimeoutError:
        return f"no answer within {CHECK_TIMEOUT_S:g} s"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else 'failed'}"
    return "ok"


async def readiness(checks: Mapping[str, Check]) -> JSONResponse:
    names = list(checks)
    results = dict(zip(names, await asyncio.gather(*(_run(checks[n]) for n in names)), strict=True))
    failing = {name: why for name, why in results.items() if why != "ok"}
    if not failing:
        return JSONResponse({"status": "ready", "checks": results})
    detail = "; ".join(f"{name}: {why}" for name, why in failing.items())
    document = problems.body(503, "not-ready", "Not ready", f"not ready: {detail}", checks=results)
    return problems.response(document, 503, headers={"Retry-After": str(RETRY_AFTER_S)})


class Readiness(BaseModel):
    status: str = Field(description="`ready`")
    checks: dict[str, str] = Field(description="each dependency: `ok`, or why not")


def delegate_check(delegate: DelegateFile) -> Check:
    """The API's delegate (`service_tokens.DelegateFile`) has a certificate that has not run out:
    past it the ledger refuses every token the API mints (agents' usage waits in their spools)."""

    async def check() -> None:
        left_s = delegate.expires_at - time.time()
        if left_s <= 0:
            raise RuntimeError(
                f"the API's delegate certificate ({delegate.path}) expired: run `gpucloud prepare` on a worker "
                "host and copy the new file here (taken up within seconds, no restart)"
            )

    return check


def install_readiness(app: FastAPI, checks: Mapping[str, Check]) -> None:
    """Add `GET /readyz` running `checks` (see the module doc)."""

    @app.get(
        "/readyz",
        tags=["health"],
        response_model=Readiness,
        responses={503: {"description": "a dependency is not usable; `checks` names each and why"}},
    )
    async def readyz() -> JSONResponse:
        """Whether the server's dependencies answer now: 200, or 503 naming those that do not."""
        return await readiness(checks)
