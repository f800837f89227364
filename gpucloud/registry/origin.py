"""The tracker service of a deployment: the weight tracker, with the registry's chunks as the origin.

The tracker service (`gpucloud.registry.tracker_app`) serves `GET /origin/chunks/{id}` for a
swarm, from the registry store of the tenant whose rollout registered that swarm, to nodes that
hold the token the rollout gave them for it: a chunk id alone opens nothing, and no tenant's
chunk is served for another's swarm. Swarm specs are kept in the control-plane DB, so a restart
of the tracker loses no rollout (nodes announce what they hold again). A node's token is honoured
only while the DB has the node in the allocation the token names (`DatabaseHolders`).
"""

from __future__ import annotations

from collections.abc import Collection

from fastapi import FastAPI
from sqlalchemy.exc import IntegrityError

from gpucloud import bootstrap
from gpucloud.config import Settings
from gpucloud.db import Database
from gpucloud.registry.swarm import SwarmSpec
from gpucloud.web.service_tokens import load_verifier, public_key_path
from gpucloud.web.tls import serve_options


class DatabaseSwarms:
    """Swarm specs kept in the control-plane DB (`tracker_swarm`), so the tracker answers for a
    rollout's swarm after a restart."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def save(self, name: str, spec: SwarmSpec) -> SwarmSpec:
        from gpucloud.models.registry_tables import TrackerSwarm

        with self._db.session() as session:
            row = session.get(TrackerSwarm, name)
            if row is None:
                session.add(TrackerSwarm(name=name, tenant_id=spec.tenant, spec=spec.model_dump_json()))
                try:
                    session.commit()
                    return spec
                except IntegrityError:  # registered by a retry meanwhile: the kept one answers
                    session.rollback()
                    row = session.get(TrackerSwarm, name)
            assert row is not None
            return SwarmSpec.model_validate_json(row.spec)

    def load(self, name: str) -> SwarmSpec | None:
        from gpucloud.models.registry_tables import TrackerSwarm

        with self._db.session() as session:
            row = session.get(TrackerSwarm, name)
            return SwarmSpec.model_validate_json(row.spec) if row is not None else None

    def delete(self, name: str) -> None:
        from gpucloud.models.registry_tables import TrackerSwarm

        with self._db.session() as session:
            row = session.get(TrackerSwarm, name)
            if row is not None:
                session.delete(row)
                session.commit()


class DatabaseHolders:
    """Who holds each node now, read from the control-plane DB (`services.nodes.holdings`): the
    tracker honours a node's swarm token only while the node is in the allocation it names.

    Why the tracker reads the node's allocation rather than checking a revocation list that
    releases write: the node's row is what every path that takes a node from a tenant changes
    already (release, drain, repair, RMA, and any path added later), in the transaction that
    moves its state, so no path can forget to revoke, and nothing new is written or swept. A
    token is dead the moment its node leaves, whatever its expiry. The cost is one batched
    primary-key read per swarm every few seconds (`tracker_app.SwarmHolders`), however many
    calls its nodes make.
    """

    def __init__(self, db: Database) -> None:
        self._db = db

    def holders(self, nodes: Collection[str]) -> dict[str, tuple[str | None, str | None]]:
        from gpucloud.services.nodes import holdings

        with self._db.session() as session:
            return {node: (h.tenant_id, h.allocation_id) for node, h in holdings(session, nodes).items()}


def create_deployment_tracker(settings: Settings) -> FastAPI:
    """The tracker of a deployment: swarms kept in the control-plane DB, chunks served from each
    swarm's tenant's registry store, every caller checked against the control plane's key, every
    node against the allocation its token names."""
    from gpucloud.registry.tracker_app import SwarmHolders, create_tracker_app
    from gpucloud.web.metrics import install_metrics
    from gpucloud.web.readiness import database_check, install_readiness, object_store_check

    db = bootstrap.database(settings)
    stores = bootstrap.registry_stores(settings)
    app = create_tracker_app(
        tenant_chunks=stores.chunks,
        # The issuer key's public half only, as the ledger: nodes reach the tracker.
        verifier=load_verifier(public_key_path(settings.issuer_key_path)),
        store=DatabaseSwarms(db),
        holders=SwarmHolders(DatabaseHolders(db), fresh_s=settings.tracker.holders_fresh_s),
        request_body=settings.request_body,
    )
    install_readiness(app, {"database": database_check(db.engine), "object store": object_store_check(stores.objects)})
    install_metrics(app, lambda: (settings.metrics_token, settings.operator_token))
    return app


def serve_tracker(settings: Settings) -> None:
    """Run the tracker and origin until stopped: on `tracker.host` (else the URL's host) and the
    URL's port. The URL is what nodes reach (`https://tracker.internal:8480`), which need not be
    an address of this host: behind a load balancer or NAT it binds to `tracker.host`."""
    import httpx
    import uvicorn

    from gpucloud.registry.tracker_app import KEEPALIVE_S

    url = httpx.URL(settings.tracker.url)
    host = settings.tracker.host or url.host
    secure = serve_options(host, settings.tls.server, insecure=settings.tls.insecure, what="tracker")
    # Keep-alive longer than clients keep idle connections (as `PeerServer` does), so the server
    # never closes one just as a client sends on it.
    uvicorn.run(
        create_deployment_tracker(settings),
        host=host,
        port=url.port or 80,
        log_level="warning",
        log_config=None,
        timeout_keep_alive=int(4 * KEEPALIVE_S),
        backlog=4096,
        **secure,
    )
