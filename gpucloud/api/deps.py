"""FastAPI dependencies: settings, DB session, the caller, the Temporal client and the ledger client."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from sqlmodel import Session, SQLModel
from temporalio.client import Client

from gpucloud.api import auth
from gpucloud.config import Settings
from gpucloud.db import Database
from gpucloud.ledger.client import LedgerClient
from gpucloud.models.operator_roles import Scope
from gpucloud.services import visibility
from gpucloud.web.problems import Problem
from gpucloud.web.service_tokens import EVALUATION

RowT = TypeVar("RowT", bound=SQLModel)


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


Reads = Callable[..., AbstractContextManager[Session]]


async def get_reads(request: Request) -> Reads:
    """Sessions for reads (the injected Database's `db.reads()`, `db.read_scope`: a reader's
    connection, each statement its own transaction; `reads(snapshot=True)`: one snapshot for all
    of them). A handler opens and
    closes one inside its own thread, `with reads() as session:`, so it never holds a connection
    across a hop between threads, and on SQLite a read neither waits for the writer's one
    connection nor takes the write lock."""
    return request.app.state.db.reads


async def get_db(request: Request) -> Database:
    """The control-plane database (`db.Database`, built by the bootstrap): the one door to a
    session that writes, `with db.session() as session:`, opened and closed inside one thread."""
    return request.app.state.db


async def get_temporal(request: Request) -> Client:
    return request.app.state.temporal


SettingsDep = Annotated[Settings, Depends(get_settings)]
ReadsDep = Annotated[Reads, Depends(get_reads)]
DbDep = Annotated[Database, Depends(get_db)]
TemporalDep = Annotated[Client, Depends(get_temporal)]


async def get_any_caller(request: Request) -> auth.Caller:
    """The caller the gate (`api/gate.py`) authenticated before the body was read: every path
    but the open ones passes it, and none of those asks for a caller."""
    caller = getattr(request.state, "caller", None)
    if caller is None:
        raise Problem(401, "unauthenticated", "Authentication required", "send 'Authorization: Bearer <api key>'")
    return caller


async def get_caller(caller: Annotated[auth.Caller, Depends(get_any_caller)]) -> auth.Caller:
    """A tenant or an operator: a node's agent credential opens only the report endpoints, and
    an evaluation's token only the reads of its versions (`VersionReaderDep`)."""
    if caller.role == EVALUATION:
        raise Problem(
            403,
            "forbidden",
            "Not for evaluations",
            "an evaluation's token reads only its version's manifest and chunks",
        )
    if caller.role == "agent":
        raise Problem(
            403,
            "forbidden",
            "Not for node agents",
            f"the agent credential of {caller.node_id} only reports for its node (/v1/agents/...)",
        )
    if caller.role not in ("tenant", "operator"):  # fail closed on every other kind of caller
        raise Problem(403, "forbidden", "Not for this credential", f"a {caller.role} credential cannot call this")
    return caller


def _require(caller: auth.Caller, scope: Scope) -> None:
    if scope not in caller.scopes:
        held = ", ".join(sorted(caller.scopes)) or "none"
        raise Problem(
            403,
            "insufficient-scope",
            "Operator scope too low",
            f"this needs the operator scope {scope.value!r}; operator {caller.operator} holds: {held}",
            required_scope=scope.value,
        )


async def get_reading_caller(request: Request, caller: Annotated[auth.Caller, Depends(get_caller)]) -> auth.Caller:
    """A tenant, or an operator holding `read` on a read. A route that takes this and changes
    something declares no operator scope, so operators are refused it (fail closed): a route
    operators may change things through takes `caller_or_operator(scope)` instead."""
    if caller.is_operator:
        if request.method not in ("GET", "HEAD"):
            raise Problem(
                403,
                "forbidden",
                "Not an operator action",
                "this route declares no operator scope for changes; call it with the tenant's API key",
            )
        _require(caller, Scope.READ)
    return caller


def operator_with(scope: Scope) -> Callable[..., Any]:
    """The dependency of a route for operators only, holding `scope` (403 naming it else)."""

    async def dependency(caller: Annotated[auth.Caller, Depends(get_caller)]) -> auth.Caller:
        if not caller.is_operator:
            raise Problem(
                403, "forbidden", "Operator only", f"this endpoint needs an operator token with {scope.value!r}"
            )
        _require(caller, scope)
        return caller

    return dependency


def caller_or_operator(scope: Scope) -> Callable[..., Any]:
    """The dependency of a route a tenant calls for its own resources and an operator holding
    `scope` for anyone's."""

    async def dependency(caller: Annotated[auth.Caller, Depends(get_caller)]) -> auth.Caller:
        if caller.is_operator:
            _require(caller, scope)
        return caller

    return dependency


CallerDep = Annotated[auth.Caller, Depends(get_reading_caller)]
# One alias per scope an operator route may need (`services.operators`): each route names its own.
ReadOperatorDep = Annotated[auth.Caller, Depends(operator_with(Scope.READ))]
FleetOperatorDep = Annotated[auth.Caller, Depends(operator_with(Scope.FLEET))]
BillingOperatorDep = Annotated[auth.Caller, Depends(operator_with(Scope.BILLING))]
TenantsOperatorDep = Annotated[auth.Caller, Depends(operator_with(Scope.TENANTS))]
OperatorsAdminDep = Annotated[auth.Caller, Depends(operator_with(Scope.OPERATORS))]
CallerOrReadOperatorDep = Annotated[auth.Caller, Depends(caller_or_operator(Scope.READ))]
CallerOrFleetOperatorDep = Annotated[auth.Caller, Depends(caller_or_operator(Scope.FLEET))]
CallerOrTenantsOperatorDep = Annotated[auth.Caller, Depends(caller_or_operator(Scope.TENANTS))]


async def get_tenant(caller: Annotated[auth.Caller, Depends(get_caller)]) -> auth.TenantCaller:
    if not caller.is_tenant or caller.tenant_id is None:
        raise Problem(
            403,
            "forbidden",
            "Tenant only",
            f"{'operators act' if caller.is_operator else 'a node agent acts'} for no tenant here; "
            "call with the tenant's API key",
        )
    return auth.TenantCaller(tenant_id=caller.tenant_id, key_id=caller.key_id)


def reporter(scope: Scope) -> Callable[..., Any]:
    """Who may report what nodes see: a node's agent (for its own node only) or an operator
    holding `scope` (the simulated fleet reports for every node)."""

    async def dependency(caller: Annotated[auth.Caller, Depends(get_any_caller)]) -> auth.Caller:
        if caller.role not in ("agent", "operator"):
            raise Problem(403, "forbidden", "Agents only", "node reports need the node's agent credential")
        if caller.is_operator:
            _require(caller, scope)
        return caller

    return dependency


ReporterDep = Annotated[auth.Caller, Depends(reporter(Scope.FLEET))]
# An operator's ledger token may change the books (the ledger's `operator` role): billing's.
LedgerReporterDep = Annotated[auth.Caller, Depends(reporter(Scope.BILLING))]
TenantDep = Annotated[auth.TenantCaller, Depends(get_tenant)]


async def get_version_reader(caller: Annotated[auth.Caller, Depends(get_any_caller)]) -> auth.Caller:
    """A tenant, or an evaluation's token (for its tenant; the route checks that what is read
    belongs to the model and versions the token names: `scoped_versions`)."""
    if caller.role == EVALUATION:
        return caller
    return await get_tenant(await get_caller(caller))


VersionReaderDep = Annotated[auth.Caller, Depends(get_version_reader)]


def scoped_versions(caller: auth.Caller, model: str) -> frozenset[str] | None:
    """The versions of `model` an evaluation's token may read (None: a tenant, who reads all of
    its own); 403 for another model."""
    if caller.role != EVALUATION:
        return None
    if caller.model != model:
        raise out_of_scope(f"model {model!r}")
    return caller.versions


def out_of_scope(what: str) -> Problem:
    return Problem(403, "forbidden", "Outside the evaluation's scope", f"this evaluation's token does not read {what}")


async def get_ledger(request: Request) -> LedgerClient:
    ledger = getattr(request.app.state, "ledger", None)
    if ledger is None:
        # Not a transient outage (which is 503 with Retry-After): this deployment bills nothing.
        raise Problem(
            501,
            "billing-not-configured",
            "Billing is not configured",
            "this control plane has no ledger (set GPUCLOUD_LEDGER__URL)",
        )
    return ledger


LedgerDep = Annotated[LedgerClient, Depends(get_ledger)]


def visible(session: Session, caller: auth.Caller, table: type[RowT], kind: str, ident: str) -> RowT:
    """The row with this id if the caller may see it (`services.visibility`): the operator any, a
    tenant its own; anything else is the same 404 as a missing row."""
    return visibility.visible(session, table, kind, ident, tenant_id=caller.tenant_id, operator=caller.is_operator)
