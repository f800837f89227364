"""Tenant services without a server: which quota applies, key rotation and revocation, status
moves and DB-allocated VNIs, on a migrated SQLite database."""

from __future__ import annotations

from datetime import timedelta

import pytest

from gpucloud.db import migrate, session_scope
from gpucloud.models.tables import TenantQuotaBase, TenantStatus, utcnow
from gpucloud.services import api_keys, tenants
from gpucloud.services.quotas import effective_limit

pytestmark = pytest.mark.unit


def q(gpu_type: str, region: str, max_gpus: int) -> TenantQuotaBase:
    return TenantQuotaBase(gpu_type=gpu_type, region=region, max_gpus=max_gpus)


@pytest.mark.parametrize(
    ("gpu_type", "region", "limit"),
    [
        ("H100", "us-east-1", 8),  # exact type and region
        ("H100", "eu-west-1", 16),  # exact type, any region
        ("B200", "us-east-1", 32),  # any type, exact region
        ("B200", "eu-west-1", 64),  # any type, any region
    ],
)
def test_the_most_specific_quota_applies(gpu_type, region, limit):
    rows = [q("*", "*", 64), q("*", "us-east-1", 32), q("H100", "*", 16), q("H100", "us-east-1", 8)]
    found = effective_limit(rows, gpu_type=gpu_type, region=region)
    assert found is not None and found.max_gpus == limit


def test_without_a_matching_quota_nothing_is_granted():
    """Before: a type and region no row matched fell back to a default of 8,192 GPUs, so a cap on
    one type left every other uncapped."""
    assert effective_limit([q("A100", "*", 8)], gpu_type="H100", region="us-east-1") is None
    assert effective_limit([], gpu_type="H100", region="us-east-1") is None


@pytest.fixture
def db(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'unit.db'}"
    migrate(url)
    return url


def _tenant(db: str, name: str) -> str:
    with session_scope(db) as session:
        tenant, _op, _key, _plain = tenants.create(session, name=name, quotas=[q("*", "*", 8)], actor="operator:test")
        return tenant.id


def test_rotation_and_revocation(db):
    tenant_id = _tenant(db, "acme")
    now = utcnow()
    with session_scope(db) as session:
        key = api_keys.list_keys(session, tenant_id)[0]
        old, new, plaintext = api_keys.rotate_key(session, tenant_id, key.id, grace=timedelta(minutes=5), now=now)
        assert old.replaced_by == new.id and plaintext.startswith(f"gpc_{new.id}.")
        assert api_keys.is_valid(old, now + timedelta(minutes=4))
        assert not api_keys.is_valid(old, now + timedelta(minutes=6))
        with pytest.raises(api_keys.KeyNotRotatable):
            api_keys.rotate_key(session, tenant_id, key.id, grace=timedelta(0))
        with pytest.raises(api_keys.KeyNotFound):
            api_keys.rotate_key(session, "ten_other", new.id, grace=timedelta(0))
        revoked = api_keys.revoke_key(session, tenant_id, new.id, now=now)
        assert not api_keys.is_valid(revoked, now)
        assert api_keys.revoke_key(session, tenant_id, new.id).revoked_at == revoked.revoked_at
        assert api_keys.revoke_all(session, tenant_id) == 1  # the rotated one was still unrevoked


def test_status_moves_are_compare_and_swap(db):
    tenant_id = _tenant(db, "acme")
    with session_scope(db) as session:
        assert (
            tenants.move(session, tenant_id, source=(TenantStatus.ONBOARDING,), target=TenantStatus.ACTIVE).status
            == "active"
        )
        # Again: already there, a no-op.
        assert (
            tenants.move(session, tenant_id, source=(TenantStatus.ONBOARDING,), target=TenantStatus.ACTIVE).status
            == "active"
        )
        with pytest.raises(tenants.TenantStateConflict):
            tenants.move(session, tenant_id, source=(TenantStatus.ONBOARDING,), target=TenantStatus.FAILED)
    with session_scope(db) as session, pytest.raises(tenants.TenantExists):
        tenants.create(session, name="acme", quotas=[], actor="operator:test")


def test_db_vnis_are_unique_idempotent_and_released(db):
    ids = [_tenant(db, f"t{i}") for i in range(4)]
    with session_scope(db) as session:
        vnis = [tenants.allocate_db_vni(session, t) for t in ids]
        assert len(set(vnis)) == 4
        assert tenants.allocate_db_vni(session, ids[0]) == vnis[0]
        tenants.record_vni(session, ids[3], None)
    late = _tenant(db, "late")
    with session_scope(db) as session:
        assert tenants.get(session, ids[3]).vni is None
        assert tenants.allocate_db_vni(session, late) not in vnis[:3]
