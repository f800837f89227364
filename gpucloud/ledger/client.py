"""The one client of the ledger's HTTP API: :class:`LedgerClient` (async) for the control plane
(the API's billing proxy, the billing activities) and :class:`UsageLedger` (blocking) for the
agents' shippers, the real agent's and the simulated fleet's alike.

Both classify answers the same way (`_checked`): a transport error or a 5xx the ledger marks
retryable raises :class:`LedgerUnavailable` (try again later); any other non-2xx raises
:class:`LedgerRefused` with the ledger's problem document, so callers can pass its status and
detail on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
from pydantic import TypeAdapter

from gpucloud.ledger.schemas import (
    AllocationEventIn,
    AllocationEventOut,
    PeriodCloseOut,
    PeriodOut,
    PriceBookVersionIn,
    PriceBookVersionOut,
    ReconciliationReport,
    ReservationIn,
    ReservationOut,
)
from gpucloud.models.billing_messages import InvoiceOut, UsageSummary
from gpucloud.web import tls
from gpucloud.web.http_client import async_http_client, http_client
from gpucloud.web.service_tokens import LEDGER_AUDIENCE, Minter

_PERIODS = TypeAdapter(list[PeriodOut])
_INVOICES = TypeAdapter(list[InvoiceOut])
_VERSIONS = TypeAdapter(list[PriceBookVersionOut])


class LedgerUnavailable(Exception):
    """The ledger did not answer, or failed in a way a retry can get past."""


class LedgerRefused(Exception):
    """The ledger answered no for good (a 4xx, or an integrity failure)."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        super().__init__(problem.get("detail") or f"ledger answered HTTP {status}")
        self.status = status
        self.problem = problem


def _checked(response: httpx.Response) -> httpx.Response:
    """The response if it is a 2xx, else the error it means."""
    if response.is_success:
        return response
    try:
        problem = response.json()
    except ValueError:
        problem = {"detail": response.text[:500]}
    if not isinstance(problem, dict):
        problem = {"detail": str(problem)[:500]}
    if response.status_code >= 500 and problem.get("retryable", True):
        raise LedgerUnavailable(f"ledger answered {response.status_code}: {problem.get('detail')}")
    raise LedgerRefused(response.status_code, problem)


class UsageLedger:
    """What a node's shipper asks of the ledger: take a batch of usage samples. `token` gives
    the bearer token to send (a node's agent: one for its own node, `AgentLedgerToken`); a
    token the ledger refuses is asked for again next time, and the batch waits in the spool."""

    def __init__(
        self,
        base_url: str,
        *,
        token: Callable[[], str] | None = None,
        timeout_s: float = 30.0,
        http: httpx.Client | None = None,
    ) -> None:
        self._url = base_url.rstrip("/") + "/v1/usage:batch"
        self._http = http or http_client(timeout="ledger", timeout_s=timeout_s, trust=tls.client_verify())
        self._token = token

    def ingest(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        """The ledger's answer to a batch (accepted, duplicates, rejections)."""
        body = json.dumps({"samples": samples}, separators=(",", ":"))
        headers = {"content-type": "application/json"}
        try:
            if self._token is not None:
                headers["authorization"] = f"Bearer {self._token()}"
            response = self._http.post(self._url, content=body, headers=headers)
        except httpx.HTTPError as error:
            raise LedgerUnavailable(f"ledger unreachable: {error!r}") from error
        if response.status_code == 401:
            # A token that expired or that the ledger does not know yet: not the batch's fault.
            raise LedgerUnavailable(f"the ledger refused this node's token: {response.text[:300]}")
        try:
            return _checked(response).json()
        except ValueError as error:
            raise LedgerUnavailable(f"unreadable ledger answer: {error!r}") from error

    def close(self) -> None:
        self._http.close()


class AgentLedgerToken:
    """A node agent's token for the ledger, asked of the control plane with the node's credential
    (`POST /v1/agents/ledger-token`) and kept until a minute before it expires."""

    def __init__(self, control_plane_url: str, credential: Callable[[], str | None], *, timeout_s: float = 30.0):
        self._http = http_client(
            base_url=control_plane_url.rstrip("/"), timeout="ledger", timeout_s=timeout_s, trust=tls.client_verify()
        )
        self._credential = credential
        self._token, self._expires_at = "", 0.0

    def __call__(self) -> str:
        if self._expires_at - time.time() > 60:
            return self._token
        response = self._http.post("/v1/agents/ledger-token", headers={"authorization": f"Bearer {self._credential()}"})
        if response.status_code != 200:
            raise httpx.HTTPStatusError(
                f"no ledger token: HTTP {response.status_code}", request=response.request, response=response
            )
        body = response.json()
        self._token, self._expires_at = body["token"], float(body["expires_at"])
        return self._token


class LedgerClient:
    """The control plane's client: each call carries a token its issuer signs for the ledger,
    as the control plane (or as the operator, for what only operators may do)."""

    def __init__(
        self,
        base_url: str,
        *,
        issuer: Minter | None = None,
        timeout_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self._http = async_http_client(
            base_url=base_url.rstrip("/"),
            timeout="ledger",
            timeout_s=timeout_s,
            transport=transport,
            trust=tls.client_verify(),
        )
        self._issuer = issuer

    async def __aenter__(self) -> LedgerClient:
        return self

    async def __aexit__(self, *_exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, *, role: str = "control-plane", **kwargs) -> httpx.Response:
        if self._issuer is not None:
            token = self._issuer.mint(LEDGER_AUDIENCE, subject=role, role=role)
            kwargs["headers"] = {**kwargs.get("headers", {}), "authorization": f"Bearer {token}"}
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            raise LedgerUnavailable(f"ledger unreachable: {error!r}") from error
        return _checked(response)

    # ---------------------------------------------------------------- control plane -> ledger

    async def record_allocation_event(self, event: AllocationEventIn) -> AllocationEventOut:
        response = await self._request("POST", "/v1/allocation-events", json=event.model_dump(mode="json"))
        return AllocationEventOut.model_validate_json(response.content)

    async def record_reservation(self, reservation: ReservationIn) -> ReservationOut:
        """Record a capacity reservation; idempotent on its id (the same body again is a no-op,
        another body under the same id is refused with 409: `LedgerRefused`)."""
        response = await self._request("POST", "/v1/reservations", json=reservation.model_dump(mode="json"))
        return ReservationOut.model_validate_json(response.content)

    async def periods(self) -> list[PeriodOut]:
        return _PERIODS.validate_json((await self._request("GET", "/v1/periods")).content)

    async def close_period(self, period_id: str) -> PeriodCloseOut:
        response = await self._request("POST", f"/v1/periods/{period_id}:close")
        return PeriodCloseOut.model_validate_json(response.content)

    # ---------------------------------------------------------------- reads for tenants

    async def usage(
        self,
        *,
        tenant_id: str,
        allocation_id: str | None = None,
        start_ms: int | None = None,
        end_ms: int | None = None,
    ) -> UsageSummary:
        params = {"tenant_id": tenant_id, "allocation_id": allocation_id, "start": start_ms, "end": end_ms}
        response = await self._request("GET", "/v1/usage", params=_present(params))
        return UsageSummary.model_validate_json(response.content)

    async def invoices(self, *, tenant_id: str | None = None, period_id: str | None = None) -> list[InvoiceOut]:
        params = _present({"tenant_id": tenant_id, "period_id": period_id})
        return _INVOICES.validate_json((await self._request("GET", "/v1/invoices", params=params)).content)

    async def invoice(self, invoice_id: int, *, tenant_id: str | None = None) -> httpx.Response:
        """The stored invoice; the response's body is its exact bytes, its headers name it."""
        return await self._request("GET", f"/v1/invoices/{invoice_id}", params=_present({"tenant_id": tenant_id}))

    async def draft_invoice(self, period_id: str, tenant_id: str) -> httpx.Response:
        return await self._request("GET", f"/v1/periods/{period_id}/draft-invoices/{tenant_id}")

    # ---------------------------------------------------------------- operator

    async def price_book_versions(self) -> list[PriceBookVersionOut]:
        return _VERSIONS.validate_json((await self._request("GET", "/v1/price-book/versions")).content)

    async def create_price_book_version(self, version: PriceBookVersionIn) -> PriceBookVersionOut:
        response = await self._request(
            "POST", "/v1/price-book/versions", role="operator", json=version.model_dump(mode="json")
        )
        return PriceBookVersionOut.model_validate_json(response.content)

    async def reconciliation(self, *, tenant_id: str, day: str) -> ReconciliationReport:
        response = await self._request("GET", "/v1/reconciliation", params={"tenant_id": tenant_id, "day": day})
        return ReconciliationReport.model_validate_json(response.content)


def _present(params: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in params.items() if value is not None}
