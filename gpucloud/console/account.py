"""The tenant's own pages beyond its allocations:

- usage and invoices, asked of the billing ledger as the API's billing router asks it
  (`LedgerClient.usage`, `.invoices`, a period's bounds from `ledger/periods`); a control plane
  without a ledger says so, a ledger that does not answer too;
- models with their versions (aliases, metrics, lineage), each version's evaluations (their
  state, its verdict for `staging` and `production`) and the aliases promoted to it, read through
  the registry's services (`promotion.publish_models`, `.publish_versions`, `evaluations_of`,
  `registry_versions.promotion_verdicts`) as `GET /v1/models...` reads them; and promote (move an
  alias) through `registry_versions.move_alias`, as `PUT /v1/models/{name}/aliases/{alias}`;
- API keys: create, rotate (with the grace the old key keeps working) and revoke, through
  `services/api_key_requests` as `/v1/api-keys` does, each change an operation naming the key
  used. A new key's secret is in the page that answers its creation and nowhere else: the list
  shows ids only, and the page is never cached (`Cache-Control: no-store`).
"""

from __future__ import annotations

import functools
import re
import time
from typing import Any, NamedTuple

from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import TypeAdapter, ValidationError
from sqlmodel import col, select

from gpucloud.api.auth import TenantCaller
from gpucloud.api.deps import DbDep, ReadsDep, SettingsDep, TenantDep
from gpucloud.config import Settings
from gpucloud.console import web
from gpucloud.console.session import PREFIX
from gpucloud.ledger.client import LedgerClient, LedgerRefused, LedgerUnavailable
from gpucloud.ledger.periods import PERIOD_PATTERN, period_bounds, period_of
from gpucloud.models.api_schemas import RotateRequest
from gpucloud.models.registry_names import AliasName
from gpucloud.models.registry_tables import AliasMove, GateSpec, ModelAliasPublic, ModelVersion, RegistryModel
from gpucloud.models.tables import utcnow
from gpucloud.registry import promotion
from gpucloud.services import api_key_requests, registry_versions
from gpucloud.services.errors import Conflict, Invalid
from gpucloud.services.evaluations import evaluations_of
from gpucloud.services.registry_models import model_row
from gpucloud.web.problems import field_of

router = web.pages_router()
LISTED = 200
MICRO = 1_000_000


def money(micro: int) -> str:
    return f"{micro / MICRO:,.2f}"


def gpu_hours(gpu_ms: int) -> str:
    return f"{gpu_ms / 3_600_000:,.2f}"


web.TEMPLATES.filters.update(money=money, gpu_hours=gpu_hours)


# ---------------------------------------------------------------- usage and invoices


@router.get("/usage")
async def usage_page(request: Request, tenant: TenantDep, period: str = "") -> Response:
    period = period.strip()
    error = None
    if period and not re.fullmatch(PERIOD_PATTERN, period):
        error, period = f"period: {period!r} is not a month as YYYY-MM", ""
    period = period or period_of(time.time_ns() // 1_000_000)
    ledger: LedgerClient | None = getattr(request.app.state, "ledger", None)
    usage = invoices = None
    unavailable = None
    if ledger is None:
        unavailable = "Billing is not configured on this control plane: there is no usage or invoice to show."
    else:
        start_ms, end_ms = period_bounds(period)
        try:
            usage = await ledger.usage(tenant_id=tenant.tenant_id, start_ms=start_ms, end_ms=end_ms)
            invoices = await ledger.invoices(tenant_id=tenant.tenant_id)
        except LedgerUnavailable:
            unavailable = "The billing ledger does not answer; try again later."
        except LedgerRefused as exc:
            unavailable = f"The billing ledger refused: {exc}"
    return web.page(
        request,
        "usage.html",
        period=period,
        usage=usage,
        invoices=invoices,
        unavailable=unavailable,
        error=error,
        status=422 if error else 200,
    )


# ---------------------------------------------------------------- models


@router.get("/models")
def models_page(request: Request, tenant: TenantDep, reads: ReadsDep) -> Response:
    with reads() as session:
        rows = session.exec(
            select(RegistryModel)
            .where(col(RegistryModel.tenant_id) == tenant.tenant_id)
            .order_by(col(RegistryModel.seq))
            .limit(LISTED)
        ).all()
        models = promotion.publish_models(session, list(rows))
    return web.page(request, "models.html", models=models)


class GateRow(NamedTuple):
    """One of the model's gates against a version: its value and why it fails (none: it passes)."""

    gate: GateSpec
    value: float | None
    fails: list[str]


def _gate_rows(
    gates: list[GateSpec],
    results: dict[str, promotion.VersionResults],
    verdicts: dict[str, list[registry_versions.PromotionVerdict]],
    digest: str,
) -> list[GateRow]:
    # The model's own gates are the same for staging and production: staging's verdict has them.
    failures = next(v.failures for v in verdicts[digest] if v.alias == AliasName.STAGING)
    return [
        GateRow(
            gate,
            results[digest].platform.get(gate.source.value, {}).get(gate.metric),
            [f.reason for f in failures if f.metric == gate.metric and f.evaluator == gate.source.value],
        )
        for gate in gates
    ]


def _model_page(
    request: Request, reads: Any, settings: Settings, tenant: TenantCaller, name: str, version: str, **context: Any
) -> Response:
    """A model, its versions newest first (each with its evaluations' state, its verdict for
    `staging` and `production`, the aliases promoted to it), and one version's evaluations and
    gates with the promote form (`?version=<digest>`)."""
    with reads() as session:
        model = model_row(session, tenant.tenant_id, name)
        public = promotion.publish_models(session, [model])[0]
        rows = list(
            session.exec(
                select(ModelVersion)
                .where(col(ModelVersion.model_id) == model.id)
                .order_by(col(ModelVersion.seq).desc())
                .limit(LISTED)
            ).all()
        )
        versions = promotion.publish_versions(session, tenant.tenant_id, rows)
        results = promotion.results_of(session, tenant.tenant_id, [v.digest for v in versions])
        verdicts = registry_versions.promotion_verdicts(
            session, tenant.tenant_id, model, rows, require_sanity=settings.registry.production_requires_sanity
        )
        chosen = next((v for v in versions if v.digest == version), None)
        evaluations = evaluations_of(session, tenant.tenant_id, chosen.digest) if chosen else []
    gate_rows = _gate_rows(public.gates, results, verdicts, chosen.digest) if chosen else []
    promoted: dict[str, list[ModelAliasPublic]] = {}
    for alias in public.aliases:
        promoted.setdefault(alias.version, []).append(alias)
    return web.page(
        request,
        "model.html",
        model=public,
        versions=versions,
        results=results,
        verdicts=verdicts,
        promoted=promoted,
        gate_rows=gate_rows,
        chosen=chosen,
        evaluations=evaluations,
        alias_names=[a.value for a in AliasName],
        errors=context.pop("errors", {}),
        values=context.pop("values", {}),
        form_error=context.pop("form_error", None),
        notice=context.pop("notice", None),
        status=context.pop("status", 200),
    )


@router.get("/models/{name}")
def model_page(
    request: Request,
    name: str,
    tenant: TenantDep,
    reads: ReadsDep,
    settings: SettingsDep,
    version: str = "",
    done: str = "",
) -> Response:
    notice = "Promoted." if done == "promote" else None
    return _model_page(request, reads, settings, tenant, name, version, notice=notice)


@router.post("/models/{name}/promote")
async def promote_version(
    request: Request, name: str, tenant: TenantDep, reads: ReadsDep, db: DbDep, settings: SettingsDep
) -> Response:
    """Point an alias at a version with a ticked confirmation, through the service of
    `PUT /v1/models/{name}/aliases/{alias}` (`registry_versions.move_alias`): the same gates,
    the same refusal in the same words, and the alias records the key that moved it."""
    fields = await web.form(request)
    values = {"version": fields.get("version", "").strip(), "alias": fields.get("alias", "").strip()}
    errors: dict[str, str] = {}
    move = alias = None
    try:
        alias = TypeAdapter(AliasName).validate_python(values["alias"])
    except ValidationError as exc:
        errors["alias"] = exc.errors()[0].get("msg", "invalid")
    try:
        move = AliasMove.model_validate({"version": values["version"]})
    except ValidationError as exc:
        errors["version"] = exc.errors()[0].get("msg", "invalid")
    if fields.get("confirm") != "yes":
        errors["confirm"] = "tick the box to confirm the promotion"
    page = functools.partial(_model_page, request, reads, settings, tenant, name, values["version"], values=values)
    if errors or alias is None or move is None:
        return await run_in_threadpool(functools.partial(page, errors=errors, status=422))
    call = functools.partial(
        registry_versions.move_alias,
        db,
        tenant.tenant_id,
        name,
        alias,
        move.version,
        moved_by=tenant.actor,
        require_sanity=settings.registry.production_requires_sanity,
    )
    try:
        moved = await run_in_threadpool(call)
    except Invalid as refused:
        return await run_in_threadpool(functools.partial(page, errors={refused.field: refused.message}, status=422))
    except Conflict as refused:
        return await run_in_threadpool(
            functools.partial(page, form_error=f"{refused.title}: {refused.detail}", status=409)
        )
    return web.see_other(f"{PREFIX}/models/{name}?version={moved.version}&done=promote")


# ---------------------------------------------------------------- API keys


def _keys_page(request: Request, db: Any, tenant: TenantCaller, **context: Any) -> Response:
    keys = api_key_requests.list_keys(db, tenant.tenant_id).items
    now = utcnow()
    settings: Settings = request.app.state.settings
    return web.page(
        request,
        "api_keys.html",
        keys=keys,
        # What the create form says of the API's cap: the keys that still authenticate.
        live=sum(1 for k in keys if k.revoked_at is None and (k.expires_at is None or k.expires_at > now)),
        max_keys=settings.api.max_api_keys_per_tenant,
        current=tenant.key_id,
        created=context.pop("created", None),
        errors=context.pop("errors", {}),
        failed_key=context.pop("failed_key", None),
        form_error=context.pop("form_error", None),
        notice=context.pop("notice", None),
        status=context.pop("status", 200),
    )


@router.get("/api-keys")
def api_keys_page(request: Request, tenant: TenantDep, db: DbDep, done: str = "") -> Response:
    return _keys_page(request, db, tenant, notice="Key revoked." if done == "revoke" else None)


def _forget(request: Request, key_id: str) -> None:
    """This API process stops taking the key at once (as the API's key routes do)."""
    request.app.state.credentials.forget(f"gpc_{key_id}")


@router.post("/api-keys")
async def create_key(request: Request, tenant: TenantDep, db: DbDep, settings: SettingsDep) -> Response:
    """A new key, its secret shown in this answer only."""
    cap = settings.api.max_api_keys_per_tenant
    page = functools.partial(_keys_page, request, db, tenant)
    try:
        created = await run_in_threadpool(
            functools.partial(api_key_requests.issue, db, tenant.tenant_id, actor=tenant.actor, max_keys=cap)
        )
    except Conflict as refused:
        return await run_in_threadpool(
            functools.partial(page, form_error=f"{refused.title}: {refused.detail}", status=409)
        )
    return await run_in_threadpool(functools.partial(page, created=created, status=201))


@router.post("/api-keys/{key_id}/{action}")
async def change_key(request: Request, key_id: str, action: str, tenant: TenantDep, db: DbDep) -> Response:
    """Rotate (the API's `grace_period_s`, required) or revoke one of the tenant's keys, each
    with a ticked confirmation. Revoking the key this session signed in with ends the session."""
    if action not in ("rotate", "revoke"):
        return await run_in_threadpool(functools.partial(_keys_page, request, db, tenant, status=404))
    fields = await web.form(request)
    errors: dict[str, str] = {}
    grace = None
    if action == "rotate":
        try:
            sent = fields.get("grace_period_s", "").strip()
            grace = RotateRequest.model_validate({"grace_period_s": sent} if sent else {})
        except ValidationError as exc:
            for e in exc.errors():
                errors.setdefault(field_of(tuple(e.get("loc", ()))), e.get("msg", "invalid"))
    if fields.get("confirm") != "yes":
        errors["confirm"] = f"tick the box to confirm the {action}"
    page = functools.partial(_keys_page, request, db, tenant, failed_key=key_id)
    if errors:
        return await run_in_threadpool(functools.partial(page, errors=errors, status=422))
    try:
        if grace is not None:
            call = functools.partial(
                api_key_requests.rotate, db, tenant.tenant_id, key_id, grace_s=grace.grace_period_s, actor=tenant.actor
            )
            created = await run_in_threadpool(call)
            _forget(request, key_id)
            return await run_in_threadpool(
                functools.partial(_keys_page, request, db, tenant, created=created, status=201)
            )
        revoke = functools.partial(api_key_requests.revoke, db, tenant.tenant_id, key_id, actor=tenant.actor)
        await run_in_threadpool(revoke)
        _forget(request, key_id)
    except Conflict as refused:
        return await run_in_threadpool(
            functools.partial(page, form_error=f"{refused.title}: {refused.detail}", status=409)
        )
    return web.see_other(f"{PREFIX}/api-keys?done=revoke")
