"""A real node verifies manifests with the tenant's keys the control plane sends with a prefetch
(`agent/tenant_weights.py`): the rollout sends the registered, unrevoked ones, and the node keeps
exactly the last set it was sent, across its restarts."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpucloud.activities.rollout import RolloutActivities
from gpucloud.agent.tenant_weights import SentKeys
from gpucloud.db import Database
from gpucloud.models.registry_tables import SigningKey
from gpucloud.registry.manifest import Signer, UnknownKeyError, key_id_of
from gpucloud.registry.push import StoreTarget, push
from gpucloud.registry.store import LocalChunkStore, LocalManifestStore

pytestmark = pytest.mark.unit


def _public(signer: Signer) -> str:
    return bytes(signer.verify_key).hex()


def test_a_node_trusts_exactly_the_keys_last_sent_and_keeps_them_across_a_restart(tmp_path: Path) -> None:
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    first, second = Signer.generate(), Signer.generate()
    manifests = LocalManifestStore(tmp_path / "manifests")
    target = StoreTarget(LocalChunkStore(tmp_path / "chunks"), manifests, settle_seconds=0)
    signed = push(source, model="m", target=target, signer=first).signed
    manifest = signed.manifest
    path = tmp_path / "t-1" / "trusted-keys.json"

    keys = SentKeys(path, tenant="t-1")
    with pytest.raises(UnknownKeyError):  # nothing sent yet: nothing trusted
        keys.verify(signed, tenant="t-1")
    keys.replace([_public(first)])
    assert keys.verify(signed, tenant="t-1") == manifest
    assert path.stat().st_mode & 0o077 == 0

    restarted = SentKeys(path, tenant="t-1")
    assert restarted.verify(signed, tenant="t-1") == manifest
    with pytest.raises(UnknownKeyError):  # another tenant's manifests are not signed by these
        restarted.verify(signed, tenant="t-2")
    restarted.replace([_public(second)])  # the first key was revoked
    with pytest.raises(UnknownKeyError):
        restarted.verify(signed, tenant="t-1")


def test_a_prefetch_carries_the_tenants_unrevoked_keys(db_url: str, tmp_path: Path) -> None:
    kept, revoked, others = Signer.generate(), Signer.generate(), Signer.generate()
    db = Database(db_url)
    with db.session() as session:
        rows = (("t-1", kept, None), ("t-1", revoked, datetime.now(UTC)), ("t-2", others, None))
        for tenant, signer, revoked_at in rows:
            public = _public(signer)
            key_id = key_id_of(signer.verify_key)
            session.add(SigningKey(tenant_id=tenant, key_id=key_id, public_key=public, revoked_at=revoked_at))
    stores = LocalManifestStore(tmp_path / "manifests")
    activities = RolloutActivities(tracker_url="http://127.0.0.1:1", manifests=lambda tenant: stores, db=db)
    assert activities._tenant_keys("t-1") == [_public(kept)]
