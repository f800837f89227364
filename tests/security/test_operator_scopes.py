"""Issue 37 item 8: every route an operator may call declares the scope it needs, and a token of
a role without that scope gets 403 naming it.

Before: one static operator token opened every route. The table below is the contract: a route
added to the API without an entry here fails the test, so a new route cannot slip in unscoped.
"""

from __future__ import annotations

import re

import pytest
from fastapi.routing import APIRoute

from gpucloud.models.operator_roles import ROLE_SCOPES, Role, Scope
from support.operators import bearer, operator_api, role_token

pytestmark = pytest.mark.integration

TENANT_ONLY = "tenant-only"  # operators are refused whatever their role
# A re-imaged node's one-time enrollment token only (`api/gate.py`): an operator's token is 401.
ENROLLMENT_ONLY = "enrollment-only"
R, F, B, T, ADMIN = Scope.READ, Scope.FLEET, Scope.BILLING, Scope.TENANTS, Scope.OPERATORS

ROUTES: dict[str, Scope | str] = {
    "POST /v1/agents/events": F,
    "POST /v1/agents/readings": F,
    "POST /v1/agents/signals": F,
    "POST /v1/agents/heartbeats": F,
    "POST /v1/agents/ledger-token": B,  # an operator's ledger token may change the books
    "GET /v1/agents/config-drive": ENROLLMENT_ONLY,
    "POST /v1/agents/enroll": ENROLLMENT_ONLY,
    "POST /v1/allocations": TENANT_ONLY,
    "GET /v1/allocations/{allocation_id}": R,
    "GET /v1/allocations": R,
    "GET /v1/allocations/{allocation_id}/nodes": R,
    "GET /v1/allocations/{allocation_id}/events": R,
    "GET /v1/allocations/{allocation_id}/nodes/{node_id}/logs": F,  # the tenant's program's text
    "POST /v1/allocations/{allocation_id}/cancel": F,
    "GET /v1/operations/{operation_id}": R,
    "POST /v1/tenants": T,
    "GET /v1/tenants": R,
    "GET /v1/tenants/{tenant_id}": R,
    "DELETE /v1/tenants/{tenant_id}": T,
    "GET /v1/tenants/{tenant_id}/quotas": R,
    "PUT /v1/tenants/{tenant_id}/quotas": T,
    "GET /v1/api-keys": TENANT_ONLY,
    "POST /v1/api-keys": TENANT_ONLY,
    "POST /v1/api-keys/{key_id}/rotate": TENANT_ONLY,
    "DELETE /v1/api-keys/{key_id}": TENANT_ONLY,
    "GET /v1/tenants/{tenant_id}/api-keys": R,
    "POST /v1/tenants/{tenant_id}/api-keys": T,
    "POST /v1/tenants/{tenant_id}/api-keys/{key_id}/rotate": T,
    "DELETE /v1/tenants/{tenant_id}/api-keys/{key_id}": T,
    "POST /v1/nodes:enroll": F,
    "GET /v1/nodes": R,
    "GET /v1/nodes/{node_id}": R,
    "POST /v1/nodes/{node_id}/cordon": F,
    "POST /v1/nodes/{node_id}/uncordon": F,
    "POST /v1/nodes/{node_id}/drain": F,
    "POST /v1/nodes/{node_id}/maintenance": F,
    "POST /v1/nodes/{node_id}/power": F,
    "POST /v1/nodes/{node_id}/hardware-replaced": F,
    "POST /v1/nodes/{node_id}/retire": F,
    "GET /v1/nodes/{node_id}/events": R,
    "GET /v1/fleet/summary": R,
    "GET /v1/fleet/spares": R,
    "POST /v1/nodes/{node_id}/agent-credential": F,
    "POST /v1/nodes/{node_id}/xid": F,
    "GET /v1/nodes/{node_id}/health": R,
    "GET /v1/alerts": R,
    "GET /v1/incidents": R,
    "GET /v1/incidents/{incident_id}": R,
    "GET /v1/incidents/{incident_id}/write-up": R,
    "POST /v1/incidents/{incident_id}/root-cause": F,
    "PATCH /v1/incidents/{incident_id}/root-cause": F,
    "POST /v1/incidents/{incident_id}:resolve": F,
    "GET /v1/fleet-incidents": R,
    "GET /v1/fleet-incidents/{incident_id}": R,
    "POST /v1/fleet-incidents/{incident_id}:resolve": F,
    "POST /v1/models": TENANT_ONLY,
    "GET /v1/models": TENANT_ONLY,
    "GET /v1/models/{name}": TENANT_ONLY,
    "PUT /v1/models/{name}/gates": TENANT_ONLY,
    "PUT /v1/models/{name}/evaluation": TENANT_ONLY,
    "DELETE /v1/models/{name}/evaluation": TENANT_ONLY,
    "GET /v1/registry/evaluator-key": TENANT_ONLY,
    "POST /v1/signing-keys": TENANT_ONLY,
    "GET /v1/signing-keys": TENANT_ONLY,
    "DELETE /v1/signing-keys/{key_id}": TENANT_ONLY,
    "POST /v1/models/{name}/chunks:missing": TENANT_ONLY,
    "PUT /v1/models/{name}/chunks/{chunk_id}": TENANT_ONLY,
    "GET /v1/models/{name}/chunks/{chunk_id}": TENANT_ONLY,
    "POST /v1/models/{name}/versions": TENANT_ONLY,
    "GET /v1/models/{name}/versions": TENANT_ONLY,
    "GET /v1/models/{name}/versions/{ref}": TENANT_ONLY,
    "GET /v1/models/{name}/versions/{ref}/manifest": TENANT_ONLY,
    "POST /v1/models/{name}/versions/{ref}/evaluations": TENANT_ONLY,
    "GET /v1/models/{name}/versions/{ref}/evaluations": TENANT_ONLY,
    "POST /v1/models/{name}/versions/{ref}/evaluate": TENANT_ONLY,
    "PUT /v1/models/{name}/aliases/{alias}": TENANT_ONLY,
    "GET /v1/models/{name}/versions/{ref}/ancestors": TENANT_ONLY,
    "GET /v1/models/{name}/versions/{ref}/descendants": TENANT_ONLY,
    "POST /v1/registry/gc": F,
    "GET /v1/usage": R,
    "GET /v1/invoices": R,
    "GET /v1/invoices:draft": R,
    "GET /v1/invoices/{invoice_id}": R,
    "GET /v1/billing/price-book/versions": R,
    "POST /v1/billing/price-book/versions": B,
    "GET /v1/billing/reconciliation": R,
    "POST /v1/rollouts": TENANT_ONLY,
    "GET /v1/rollouts": R,
    "GET /v1/rollouts/{rollout_id}": R,
    "POST /v1/rollouts/{rollout_id}:pause": F,
    "POST /v1/rollouts/{rollout_id}:resume": F,
    "POST /v1/rollouts/{rollout_id}:abort": F,
    "GET /v1/queue": R,
    "GET /v1/tenants/{tenant_id}/shares": R,
    "PUT /v1/tenants/{tenant_id}/shares": T,
    "POST /v1/reservations": TENANT_ONLY,
    "GET /v1/reservations": R,
    "GET /v1/reservations/{reservation_id}": R,
    "POST /v1/reservations/{reservation_id}/cancel": F,
    "GET /v1/catalog": R,
    "GET /v1/whoami": R,
    "POST /v1/operators": ADMIN,
    "GET /v1/operators": ADMIN,
    "POST /v1/operators/{name}/rotate": ADMIN,
    "DELETE /v1/operators/{name}": ADMIN,
}
OPEN = {"GET /healthz", "GET /readyz", "GET /metrics"}


def _routes(routes: list) -> list[str]:
    found = []
    for route in routes:
        if isinstance(route, APIRoute):
            found += [f"{method} {route.path}" for method in sorted(route.methods)]
    return found


def _concrete(path: str) -> str:
    # Path parameters that name nothing: a role with the scope gets past auth to a 404 or 422.
    return re.sub(r"\{(\w+)\}", lambda m: "1" if m.group(1) == "invoice_id" else "nothing", path)


@pytest.mark.parametrize("role", list(Role))
def test_every_operator_route_refuses_a_role_without_its_scope(tmp_path, role: Role) -> None:
    with operator_api(tmp_path) as (client, settings):
        # The console's pages take no bearer token: their session's role is checked page by page
        # (tests/console/test_console_sessions.py).
        declared = [r for r in _routes(client.app.routes) if not r.split(" ", 1)[1].startswith("/console")]  # type: ignore[attr-defined]
        unlisted = sorted(set(declared) - set(ROUTES) - OPEN)
        assert not unlisted, f"routes without a scope in this table: {unlisted}"
        assert not set(ROUTES) - set(declared), "routes in the table the API no longer has"
        headers = bearer(role_token(settings, f"op-{role.value}", role))
        held = ROLE_SCOPES[role]
        for route, needed in ROUTES.items():
            method, path = route.split(" ", 1)
            body = {} if method in ("POST", "PUT") else None
            resp = client.request(method, _concrete(path), headers=headers, json=body)
            if needed == ENROLLMENT_ONLY:
                assert resp.status_code == 401 and "enrollment token" in resp.text.lower(), (route, resp.text)
            elif needed == TENANT_ONLY:
                assert resp.status_code == 403 and resp.json()["type"].endswith("forbidden"), (route, resp.text)
            elif needed in held:
                assert resp.status_code != 403, (route, role, resp.text)
            else:
                problem = resp.json()
                assert resp.status_code == 403, (route, role, resp.text)
                assert problem["required_scope"] == needed.value, (route, problem)
                assert repr(needed.value) in problem["detail"], problem["detail"]


def test_the_roles_split_as_the_issue_says() -> None:
    """Read-only reads; the fleet operator acts on the fleet, not on billing; the billing admin
    bills, and touches no node; only admins manage operators."""
    assert ROLE_SCOPES[Role.READ_ONLY] == {Scope.READ}
    assert Scope.FLEET in ROLE_SCOPES[Role.FLEET] and Scope.BILLING not in ROLE_SCOPES[Role.FLEET]
    assert Scope.BILLING in ROLE_SCOPES[Role.BILLING] and Scope.FLEET not in ROLE_SCOPES[Role.BILLING]
    assert [r for r in Role if Scope.OPERATORS in ROLE_SCOPES[r]] == [Role.ADMIN]
