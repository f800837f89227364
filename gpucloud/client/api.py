"""The typed client of the public API: one attribute per resource, the routes' own wire schemas
(`gpucloud.models.api_schemas`, `gpucloud.models`) as answers. The CLI, the demo, the benchmarks and the
end-to-end tests all call the API through it.

    with Gpucloud(api_url, api_key) as api:
        accepted = api.allocations.create(gpu_type="h100", node_count=2, region="us-east-1")
        ready = api.allocations.wait(accepted.allocation.id, {"ready"}, timeout_s=300)

Creates go under an `Idempotency-Key` (a fresh one unless given), so the retries `ApiClient`
makes can never create twice; listings follow the keyset pages to the end.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from pydantic import BaseModel

from gpucloud.client.base import ApiClient, ApiError, ApiTimeout
from gpucloud.models.api_schemas import (
    AgentCredentialIssued,
    AllocationAccepted,
    AllocationNodes,
    ApiKeyCreated,
    ApiKeyList,
    Catalog,
    EnrollResult,
    FleetSpares,
    InvoiceList,
    NodeActionResult,
    NodeEventPublic,
    NodeHealth,
    OperatorList,
    OperatorTokenIssued,
    OperatorView,
    QueuePage,
    QuotaReport,
    ReservationPublic,
    RolloutAccepted,
    RolloutRequest,
    RolloutSummary,
    TenantAccepted,
    TenantOperation,
    UsageReport,
    Whoami,
    XidIngestResult,
)
from gpucloud.models.health_tables import AllocationEventPublic, IncidentPublic
from gpucloud.models.rollout_messages import RolloutProgress
from gpucloud.models.tables import AllocationPublic, ApiKeyPublic, NodePublic, OperationPublic, TenantPublic
from gpucloud.protocol.actions import Workload

__all__ = ["ApiError", "ApiTimeout", "Gpucloud", "InvoiceDocument"]

M = TypeVar("M", bound=BaseModel)
Quotas = list[dict[str, Any]]  # [{"gpu_type": "h100" or "*", "region": "us-east-1" or "*", "max_gpus": 64}]


def _body(request: BaseModel | dict[str, Any]) -> dict[str, Any]:
    """A request as JSON, without the fields left unset (the server's defaults apply)."""
    if isinstance(request, BaseModel):
        return request.model_dump(mode="json", exclude_none=True)
    return {k: v for k, v in request.items() if v is not None}


class _Resource:
    def __init__(self, api: ApiClient) -> None:
        self.api = api

    def _get(self, model: type[M], path: str, **params: Any) -> M:
        query = {k: v for k, v in params.items() if v is not None}
        return model.model_validate(self.api.get(path, params=query))

    def _post(self, model: type[M], path: str, body: dict[str, Any] | None = None, **kwargs: Any) -> M:
        return model.model_validate(self.api.call("POST", path, json=body or {}, **kwargs))

    def _create(self, model: type[M], path: str, body: dict[str, Any], key: str | None) -> M:
        return model.model_validate(self.api.create(path, body, idempotency_key=key))

    def _pages(self, model: type[M], path: str, **params: Any) -> Iterator[M]:
        return (model.model_validate(item) for item in self.api.pages(path, **params))


class Allocations(_Resource):
    def create(
        self,
        gpu_type: str,
        region: str,
        node_count: int | None = None,
        *,
        nvl72_trays: int | None = None,
        workload: Workload | None = None,
        idempotency_key: str | None = None,
        queue: bool = False,
        max_wait_s: int | None = None,
        expected_duration_s: int | None = None,
        tier: str | None = None,
    ) -> AllocationAccepted:
        """`workload`: what each node runs once provisioned (`Workload`: command, image, env, SSH keys).
        `queue`: wait in the pool's queue when there is no room (for at most `max_wait_s`)."""
        request = {
            "gpu_type": gpu_type,
            "region": region,
            "node_count": node_count,
            "nvl72_trays": nvl72_trays,
            "workload": _body(workload) if workload is not None else None,
            "capacity": _body({"wait": "queue", "max_wait_s": max_wait_s}) if queue else None,
            "expected_duration_s": expected_duration_s,
            "tier": tier,
        }
        return self._create(AllocationAccepted, "/v1/allocations", _body(request), idempotency_key)

    def get(self, allocation_id: str) -> AllocationPublic:
        return self._get(AllocationPublic, f"/v1/allocations/{allocation_id}")

    def queue(self, *, gpu_type: str | None = None, region: str | None = None) -> QueuePage:
        """The queued allocations by pool, with positions and estimated starts (a tenant's own)."""
        return self._get(QueuePage, "/v1/queue", gpu_type=gpu_type, region=region)

    def list(self, *, status: str | None = None, tenant_id: str | None = None) -> Iterator[AllocationPublic]:
        return self._pages(AllocationPublic, "/v1/allocations", status=status, tenant_id=tenant_id)

    def cancel(self, allocation_id: str) -> AllocationAccepted:
        """Cancellation is intent: the answer is the allocation on its way to `released`."""
        return self._post(AllocationAccepted, f"/v1/allocations/{allocation_id}/cancel", retry=True)

    def events(self, allocation_id: str) -> Iterator[AllocationEventPublic]:
        return self._pages(AllocationEventPublic, f"/v1/allocations/{allocation_id}/events")

    def nodes(self, allocation_id: str) -> AllocationNodes:
        """The allocation's nodes now, each with where it takes SSH while it is the allocation's."""
        return self._get(AllocationNodes, f"/v1/allocations/{allocation_id}/nodes")

    def logs(self, allocation_id: str, node_id: str, *, tail: int | None = None, follow: bool = False) -> Iterator[str]:
        """The output of the workload on one node of the allocation (stdout and stderr as the
        tenant's program wrote them: text, never interpreted), as it arrives: with `follow`, until
        the workload exits or the API's longest follow ends."""
        params = {"tail": tail, "follow": "true" if follow else None}
        path = f"/v1/allocations/{allocation_id}/nodes/{node_id}/logs"
        return self.api.stream_text(path, params={k: v for k, v in params.items() if v is not None})

    def wait(
        self,
        allocation_id: str,
        statuses: Collection[str],
        *,
        timeout_s: float,
        on_poll: Callable[[AllocationPublic], None] | None = None,
    ) -> AllocationPublic:
        """The allocation once its status is one of `statuses`; `ApiTimeout` after `timeout_s`."""
        return self.api.wait_for(
            lambda: self.get(allocation_id),
            lambda a: a.status in statuses,
            timeout_s=timeout_s,
            what=f"allocation {allocation_id} {'/'.join(sorted(statuses))}",
            on_poll=on_poll,
        )


class Operations(_Resource):
    def get(self, operation_id: str) -> OperationPublic:
        return self._get(OperationPublic, f"/v1/operations/{operation_id}")

    def wait(self, operation_id: str, *, timeout_s: float) -> OperationPublic:
        """The operation once it has succeeded or failed."""
        return self.api.wait_for(
            lambda: self.get(operation_id),
            lambda op: op.status != "running",
            timeout_s=timeout_s,
            what=f"operation {operation_id} finished",
        )


class Tenants(_Resource):
    def create(self, name: str, *, quotas: Quotas | None = None, idempotency_key: str | None = None) -> TenantAccepted:
        """Onboard a tenant (operator): the answer carries its first API key, shown once."""
        body = {"name": name, **({"quotas": quotas} if quotas else {})}
        return self._create(TenantAccepted, "/v1/tenants", body, idempotency_key)

    def get(self, tenant_id: str) -> TenantPublic:
        return self._get(TenantPublic, f"/v1/tenants/{tenant_id}")

    def list(self, *, status: str | None = None) -> Iterator[TenantPublic]:
        return self._pages(TenantPublic, "/v1/tenants", status=status)

    def offboard(self, tenant_id: str) -> TenantOperation:
        return TenantOperation.model_validate(self.api.call("DELETE", f"/v1/tenants/{tenant_id}", retry=True))

    def quotas(self, tenant_id: str) -> QuotaReport:
        return self._get(QuotaReport, f"/v1/tenants/{tenant_id}/quotas")

    def set_quotas(self, tenant_id: str, quotas: Quotas) -> QuotaReport:
        answer = self.api.call("PUT", f"/v1/tenants/{tenant_id}/quotas", json={"quotas": quotas}, retry=True)
        return QuotaReport.model_validate(answer)


class ApiKeys(_Resource):
    """The caller's own keys, or (operator) a named tenant's."""

    def _base(self, tenant_id: str | None) -> str:
        return f"/v1/tenants/{tenant_id}/api-keys" if tenant_id else "/v1/api-keys"

    def list(self, *, tenant_id: str | None = None) -> ApiKeyList:
        return self._get(ApiKeyList, self._base(tenant_id))

    def create(self, *, tenant_id: str | None = None, idempotency_key: str | None = None) -> ApiKeyCreated:
        return self._create(ApiKeyCreated, self._base(tenant_id), {}, idempotency_key)

    def rotate(self, key_id: str, *, grace_period_s: int = 0, tenant_id: str | None = None) -> ApiKeyCreated:
        """A new key replacing `key_id`; the old one keeps working for `grace_period_s`."""
        path = f"{self._base(tenant_id)}/{key_id}/rotate"
        return self._create(ApiKeyCreated, path, {"grace_period_s": grace_period_s}, None)

    def revoke(self, key_id: str, *, tenant_id: str | None = None) -> ApiKeyPublic:
        answer = self.api.call("DELETE", f"{self._base(tenant_id)}/{key_id}", retry=True)
        return ApiKeyPublic.model_validate(answer)


class Operators(_Resource):
    """Named operator accounts and their tokens (an admin's token)."""

    def create(
        self, name: str, role: str, *, expires_in_s: int | None = None, idempotency_key: str | None = None
    ) -> OperatorTokenIssued:
        body = _body({"name": name, "role": role, "expires_in_s": expires_in_s})
        return self._create(OperatorTokenIssued, "/v1/operators", body, idempotency_key)

    def list(self) -> OperatorList:
        return self._get(OperatorList, "/v1/operators")

    def rotate(self, name: str, *, grace_period_s: int = 0, expires_in_s: int | None = None) -> OperatorTokenIssued:
        """A new token for `name`; the old one keeps working for `grace_period_s`."""
        body = _body({"grace_period_s": grace_period_s, "expires_in_s": expires_in_s})
        return self._post(OperatorTokenIssued, f"/v1/operators/{name}/rotate", body)

    def revoke(self, name: str) -> OperatorView:
        return OperatorView.model_validate(self.api.call("DELETE", f"/v1/operators/{name}", retry=True))


class Nodes(_Resource):
    """The fleet, for operators (and a node's own agent credential for its reports)."""

    def list(
        self, *, state: str | None = None, gpu_type: str | None = None, region: str | None = None, page_size: int = 1000
    ) -> Iterator[NodePublic]:
        return self._pages(NodePublic, "/v1/nodes", state=state, gpu_type=gpu_type, region=region, page_size=page_size)

    def get(self, node_id: str) -> NodePublic:
        return self._get(NodePublic, f"/v1/nodes/{node_id}")

    def events(self, node_id: str) -> Iterator[NodeEventPublic]:
        return self._pages(NodeEventPublic, f"/v1/nodes/{node_id}/events")

    def health(self, node_id: str) -> NodeHealth:
        return self._get(NodeHealth, f"/v1/nodes/{node_id}/health")

    def summary(self) -> dict[str, Any]:
        return self.api.get("/v1/fleet/summary")

    def spares(self) -> FleetSpares:
        """Spare nodes per pool: needed, held, and the failure rate planned on."""
        return self._get(FleetSpares, "/v1/fleet/spares")

    def enroll(self, nodes: Collection[dict[str, Any]]) -> EnrollResult:
        """Record nodes (`NodeEnroll` each) and start their bring-up; known ones are left as they are."""
        return self._post(EnrollResult, "/v1/nodes:enroll", {"nodes": [*nodes]}, retry=True)

    def agent_credential(self, node_id: str) -> AgentCredentialIssued:
        """A new credential for the node's agent (the one before stops working): shown once."""
        return self._post(AgentCredentialIssued, f"/v1/nodes/{node_id}/agent-credential", {})

    def act(self, node_id: str, action: str, reason: str = "") -> NodeActionResult:
        """`cordon`, `uncordon` or `drain`, with the reason recorded in the node's events."""
        return self._post(NodeActionResult, f"/v1/nodes/{node_id}/{action}", {"reason": reason}, retry=True)

    def hardware_replaced(self, node_id: str, reason: str = "") -> NodeActionResult:
        """RMA done: the node is enrolled again (inspection, wipe, burn-in before it serves)."""
        return self._post(NodeActionResult, f"/v1/nodes/{node_id}/hardware-replaced", {"reason": reason})

    def retire(self, node_id: str, reason: str = "") -> NodeActionResult:
        """Out of the fleet for good (from RMA, quarantine, or enrolled)."""
        return self._post(NodeActionResult, f"/v1/nodes/{node_id}/retire", {"reason": reason})

    def power(self, node_id: str, action: str, reason: str = "") -> NodeActionResult:
        """`on`, `off` or `cycle` through the node's BMC: an operation that finishes once the
        BMC's power state shows it (`operations.wait`)."""
        return self._post(NodeActionResult, f"/v1/nodes/{node_id}/power", {"action": action, "reason": reason})

    def maintenance(self, node_id: str, enabled: bool, reason: str = "") -> NodeActionResult:
        body = {"enabled": enabled, "reason": reason}
        return self._post(NodeActionResult, f"/v1/nodes/{node_id}/maintenance", body, retry=True)

    def report_xid(self, node_id: str, xid: int, *, gpu_index: int | None = None, message: str = "") -> XidIngestResult:
        body = {"xid": xid, "gpu_index": gpu_index, "message": message}
        return self._post(XidIngestResult, f"/v1/nodes/{node_id}/xid", body)


@dataclass(frozen=True)
class InvoiceDocument:
    """An invoice as the ledger keeps it: the document, its exact bytes and their ETag."""

    body: dict[str, Any]
    raw: bytes
    etag: str
    status: str  # "final" (a closed period's) or "draft"


class Billing(_Resource):
    def usage(
        self, *, allocation_id: str | None = None, period: str | None = None, tenant_id: str | None = None
    ) -> UsageReport:
        return self._get(UsageReport, "/v1/usage", allocation_id=allocation_id, period=period, tenant_id=tenant_id)

    def invoices(self, *, period: str | None = None, tenant_id: str | None = None) -> InvoiceList:
        return self._get(InvoiceList, "/v1/invoices", period=period, tenant_id=tenant_id)

    def _document(self, path: str, **params: Any) -> InvoiceDocument:
        response = self.api.request("GET", path, params={k: v for k, v in params.items() if v is not None})
        return InvoiceDocument(
            body=response.json(),
            raw=response.content,
            etag=response.headers.get("etag", "").strip('"'),
            status=response.headers.get("invoice-status", ""),
        )

    def invoice(self, invoice_id: int | str) -> InvoiceDocument:
        return self._document(f"/v1/invoices/{invoice_id}")

    def draft(self, *, period: str | None = None, tenant_id: str | None = None) -> InvoiceDocument:
        return self._document("/v1/invoices:draft", period=period, tenant_id=tenant_id)


class Incidents(_Resource):
    """Incidents: the record of each health pull, correlated burst and breaker trip
    (`docs/health.md`, "Incidents")."""

    def list(
        self, *, status: str | None = None, node_id: str | None = None, kind: str | None = None
    ) -> Iterator[IncidentPublic]:
        return self._pages(IncidentPublic, "/v1/incidents", status=status, node_id=node_id, kind=kind)

    def get(self, incident_id: str) -> IncidentPublic:
        return self._get(IncidentPublic, f"/v1/incidents/{incident_id}")

    def write_up(self, incident_id: str) -> str:
        """The write-up, as Markdown."""
        return self.api.request("GET", f"/v1/incidents/{incident_id}/write-up").text

    def root_cause(
        self, incident_id: str, root_cause: str, follow_ups: Collection[str] | None = None
    ) -> IncidentPublic:
        """An operator's root cause and follow-ups (None: the ones written stay)."""
        body = _body({"root_cause": root_cause, "follow_ups": None if follow_ups is None else [*follow_ups]})
        return self._post(IncidentPublic, f"/v1/incidents/{incident_id}/root-cause", body)

    def resolve(self, incident_id: str, note: str = "") -> IncidentPublic:
        """An operator ends a fleet incident (a burst's component fixed, a breaker trip dealt with)."""
        return self._post(IncidentPublic, f"/v1/incidents/{incident_id}:resolve", {"note": note})


class Rollouts(_Resource):
    def create(
        self, request: RolloutRequest | dict[str, Any], *, idempotency_key: str | None = None
    ) -> RolloutAccepted:
        return self._create(RolloutAccepted, "/v1/rollouts", _body(request), idempotency_key or str(uuid.uuid4()))

    def get(self, rollout_id: str) -> RolloutProgress:
        return self._get(RolloutProgress, f"/v1/rollouts/{rollout_id}")

    def list(self) -> Iterator[RolloutSummary]:
        """The caller's rollouts, newest first, page by page as they are read."""
        return self._pages(RolloutSummary, "/v1/rollouts")

    def command(self, rollout_id: str, name: str, reason: str = "") -> RolloutProgress:
        """`pause`, `resume` or `abort`."""
        return self._post(RolloutProgress, f"/v1/rollouts/{rollout_id}:{name}", {"reason": reason}, retry=True)

    def watch(
        self,
        rollout_id: str,
        *,
        timeout_s: float,
        poll_s: float = 1.0,
        on_poll: Callable[[RolloutProgress], None] | None = None,
    ) -> RolloutProgress:
        """The rollout's progress once it has finished (succeeded, rolled back, aborted or failed)."""
        return self.api.wait_for(
            lambda: self.get(rollout_id),
            lambda p: p.finished,
            timeout_s=timeout_s,
            interval_s=poll_s,
            what=f"rollout {rollout_id} finished",
            on_poll=on_poll,
        )


class Reservations(_Resource):
    """Capacity reservations: N nodes of a pool booked for a future window (docs/scheduling.md)."""

    def create(
        self,
        gpu_type: str,
        region: str,
        node_count: int,
        start_at: datetime,
        end_at: datetime,
        *,
        idempotency_key: str | None = None,
    ) -> ReservationPublic:
        body = {
            "gpu_type": gpu_type,
            "region": region,
            "node_count": node_count,
            "start_at": start_at.isoformat(),
            "end_at": end_at.isoformat(),
        }
        return self._create(ReservationPublic, "/v1/reservations", body, idempotency_key)

    def get(self, reservation_id: str) -> ReservationPublic:
        return self._get(ReservationPublic, f"/v1/reservations/{reservation_id}")

    def list(self, *, status: str | None = None) -> Iterator[ReservationPublic]:
        return self._pages(ReservationPublic, "/v1/reservations", status=status)

    def cancel(self, reservation_id: str) -> ReservationPublic:
        return self._post(ReservationPublic, f"/v1/reservations/{reservation_id}/cancel")


class Gpucloud(ApiClient):
    """The public API as one caller (a tenant's key, or the operator token) sees it."""

    def __init__(self, base_url: str, token: str, **kwargs: Any) -> None:
        super().__init__(base_url, token, **kwargs)
        self.allocations = Allocations(self)
        self.operations = Operations(self)
        self.tenants = Tenants(self)
        self.api_keys = ApiKeys(self)
        self.operators = Operators(self)
        self.nodes = Nodes(self)
        self.billing = Billing(self)
        self.rollouts = Rollouts(self)
        self.incidents = Incidents(self)
        self.reservations = Reservations(self)

    def catalog(self, *, gpu_type: str | None = None, region: str | None = None) -> Catalog:
        """What the fleet offers: GPU types and regions, nodes available now, prices per GPU-hour."""
        params = {k: v for k, v in {"gpu_type": gpu_type, "region": region}.items() if v is not None}
        return Catalog.model_validate(self.get("/v1/catalog", params=params))

    def whoami(self) -> Whoami:
        """Who this client's credential is: a tenant (key, quotas, usage) or an operator (role)."""
        return Whoami.model_validate(self.get("/v1/whoami"))
