"""The ledger process (`gpucloud ledger`): the billing ledger's app (`gpucloud.ledger.app`) served
with uvicorn, on its own database, answering only the control plane's signed tokens."""

from __future__ import annotations

from pathlib import Path

import uvicorn
from sqlalchemy.engine import make_url

from gpucloud import bootstrap
from gpucloud.config import LedgerSettings, RequestBodySettings, Settings
from gpucloud.ledger.app import DEFAULT_DATABASE_URL, create_app
from gpucloud.observability import tracing
from gpucloud.web.gate import BODY_DEFAULTS
from gpucloud.web.service_tokens import load_verifier, public_key_path
from gpucloud.web.tls import ServerTLS, serve_options


def serve(
    settings: Settings,
    *,
    port: int | None = None,
    database_url: str | None = None,
    control_plane_key: Path | None = None,
) -> None:
    """Run the ledger as the settings say; the options given win over them."""
    bootstrap.trust_configured_ca(settings)
    main(
        host=settings.ledger.host,
        port=port or settings.ledger.port,
        database_url=database_url or settings.ledger_database_url,
        control_plane_key=control_plane_key or public_key_path(settings.issuer_key_path),
        tls=settings.tls.server,
        insecure=settings.tls.insecure,
        migrate_on_start=settings.ledger.migrate_on_start,
        metrics_tokens=(settings.metrics_token, settings.operator_token),
        request_body=settings.request_body,
        admission=settings.ledger,
    )


def main(
    host: str = "127.0.0.1",
    port: int = 8700,
    database_url: str = DEFAULT_DATABASE_URL,
    *,
    control_plane_key: Path,
    tls: ServerTLS | None = None,
    insecure: bool = False,
    migrate_on_start: bool | None = None,
    metrics_tokens: tuple[str, ...] = (),
    request_body: RequestBodySettings = BODY_DEFAULTS,
    admission: LedgerSettings | None = None,
) -> None:
    """Run the ledger until interrupted (``gpucloud ledger``), trusting the control plane's
    public key at `control_plane_key`. It migrates its database at start when `migrate_on_start`
    (unset: on SQLite only), else checks that the schema is current."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite" and url.database:
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    if not control_plane_key.is_file():
        raise SystemExit(f"no control plane public key at {control_plane_key}: the ledger answers only its tokens")
    secure = serve_options(host, tls, insecure=insecure, what="ledger")
    migrate = url.get_backend_name() == "sqlite" if migrate_on_start is None else migrate_on_start
    app = create_app(
        database_url,
        control_plane=load_verifier(control_plane_key),
        migrate_on_start=migrate,
        metrics_tokens=metrics_tokens,
        request_body=request_body,
        admission=admission,
    )
    tracing.instrument_app(app)  # when the command turned tracing on
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, log_config=None, **secure)
