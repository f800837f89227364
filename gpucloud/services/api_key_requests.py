"""What tenants and operators ask of a tenant's API keys through the API: issue (at most
`max_keys` live ones), rotate, revoke, list. Each change leaves a settled operation naming who made
it, written in the key's own transaction. Refusals are domain errors (`services/errors.py`)."""

from __future__ import annotations

from datetime import timedelta

from sqlmodel import Session, col, select

from gpucloud.db import Database
from gpucloud.models.api_schemas import ApiKeyCreated, ApiKeyList
from gpucloud.models.tables import ApiKey, ApiKeyPublic, Tenant, TenantStatus, utcnow
from gpucloud.services import api_keys as key_service
from gpucloud.services import operations
from gpucloud.services.errors import Conflict, NotFound

# A tenant being onboarded gets its keys ready; one that failed or is leaving gets none.
ISSUING = (TenantStatus.ONBOARDING, TenantStatus.ACTIVE)


def _issuing_tenant(session: Session, tenant_id: str) -> None:
    status = session.exec(select(col(Tenant.status)).where(col(Tenant.id) == tenant_id).with_for_update()).first()
    if status is None:
        raise NotFound("tenant", tenant_id)
    if status not in ISSUING:
        raise Conflict(
            f"tenant {tenant_id} is {status}; keys are issued to onboarding and active tenants only",
            type_="tenant-not-active",
            title="Tenant takes no new keys",
            tenant_status=status,
        )


def _created_key(key: ApiKey, plaintext: str, *, replaced: ApiKey | None = None) -> ApiKeyCreated:
    """The answer to a create or a rotate: the new key's secret, shown this once."""
    body = ApiKeyCreated(id=key.id, tenant_id=key.tenant_id, key=plaintext, created_at=key.created_at)
    if replaced is not None:
        body.replaces, body.replaced_key_expires_at = replaced.id, replaced.expires_at
    return body


def issue(db: Database, tenant_id: str, *, actor: str, max_keys: int) -> ApiKeyCreated:
    with db.session() as session:
        _issuing_tenant(session, tenant_id)  # locks the tenant's row: the count and the add are one step
        if key_service.live_count(session, tenant_id, utcnow()) >= max_keys:
            raise Conflict(
                f"tenant {tenant_id} already holds {max_keys} live API keys, the most a tenant may hold; "
                "revoke one it no longer uses (DELETE /v1/api-keys/{key id}) and create the new one again",
                type_="too-many-api-keys",
                title="Too many API keys",
                max_api_keys=max_keys,
            )
        key, plaintext = key_service.issue_key(session, tenant_id)
        operations.record_done(session, kind="issue_api_key", resource_id=key.id, tenant_id=tenant_id, actor=actor)
        session.flush()
        return _created_key(key, plaintext)


def rotate(db: Database, tenant_id: str, key_id: str, *, grace_s: int, actor: str) -> ApiKeyCreated:
    try:
        with db.session() as session:
            _issuing_tenant(session, tenant_id)
            old, new, plaintext = key_service.rotate_key(session, tenant_id, key_id, grace=timedelta(seconds=grace_s))
            operations.record_done(session, kind="rotate_api_key", resource_id=old.id, tenant_id=tenant_id, actor=actor)
            return _created_key(new, plaintext, replaced=old)
    except key_service.KeyNotFound as exc:
        raise NotFound("api key", key_id) from exc
    except key_service.KeyNotRotatable as exc:
        raise Conflict(str(exc), type_="key-not-rotatable", title="Key cannot be rotated") from exc


def revoke(db: Database, tenant_id: str, key_id: str, *, actor: str) -> ApiKeyPublic:
    try:
        with db.session() as session:
            revoked = key_service.revoke_key(session, tenant_id, key_id)
            operations.record_done(session, kind="revoke_api_key", resource_id=key_id, tenant_id=tenant_id, actor=actor)
            return ApiKeyPublic.model_validate(revoked, from_attributes=True)
    except key_service.KeyNotFound as exc:
        raise NotFound("api key", key_id) from exc


def list_keys(db: Database, tenant_id: str) -> ApiKeyList:
    with db.session() as session:
        if session.exec(select(col(Tenant.id)).where(col(Tenant.id) == tenant_id)).first() is None:
            raise NotFound("tenant", tenant_id)
        return ApiKeyList(
            items=[
                ApiKeyPublic.model_validate(k, from_attributes=True) for k in key_service.list_keys(session, tenant_id)
            ]
        )
