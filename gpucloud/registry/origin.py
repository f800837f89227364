"""The tracker service of a deployment: the weight tracker, with the registry's chunks as the origin.

The tracker service (`gpucloud.registry.tracker_app`) serves `GET /origin/chunks/{id}` from
one chunk store, while the registry keeps a store per tenant (`gpucloud.registry.stores`).
`RegistryOrigin` answers a chunk from the store of whichever tenant holds it; tenants are listed
from the control-plane DB on every lookup, so one onboarded since the service started is found.

The origin answers by chunk id alone: anyone who reaches it and knows a chunk's id (the BLAKE3
of its bytes) can read that chunk. It is meant for the control plane's network (`gpucloud up`
binds it to loopback); nodes outside it would need a per-tenant origin path or signed URLs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from sqlmodel import col, select

from gpucloud import bootstrap
from gpucloud.config import Settings
from gpucloud.db import Database
from gpucloud.registry.manifest import ChunkMissingError
from gpucloud.registry.stores import RegistryStores


class RegistryOrigin:
    """Read-only: what the tracker's origin endpoint asks of a chunk store (`get`)."""

    def __init__(self, stores: RegistryStores, tenants: Callable[[], Iterable[str]]) -> None:
        self._stores, self._tenants = stores, tenants

    def get(self, chunk_id: str) -> bytes:
        for tenant_id in self._tenants():
            store = self._stores.chunks(tenant_id)
            if store.has(chunk_id):
                return store.get(chunk_id)  # hashed in full by the store before it returns
        raise ChunkMissingError("no tenant's registry holds it", chunk_id=chunk_id)


def tenants_in(db: Database) -> Callable[[], list[str]]:
    from gpucloud.models.tables import Tenant

    def tenant_ids() -> list[str]:
        with db.session() as session:
            return list(session.exec(select(col(Tenant.id))).all())

    return tenant_ids


def serve_tracker(settings: Settings) -> None:
    """Run the tracker and origin on `settings.tracker.url`'s host and port until stopped."""
    import httpx
    import uvicorn

    from gpucloud.registry.tracker_app import KEEPALIVE_S, create_tracker_app

    origin = RegistryOrigin(bootstrap.registry_stores(settings), tenants_in(bootstrap.database(settings)))
    url = httpx.URL(settings.tracker.url)
    # Keep-alive longer than clients keep idle connections (as `PeerServer` does), so the server
    # never closes one just as a client sends on it.
    uvicorn.run(
        create_tracker_app(chunk_store=origin),
        host=url.host,
        port=url.port or 80,
        log_level="warning",
        timeout_keep_alive=int(4 * KEEPALIVE_S),
        backlog=4096,
    )
