"""An in-process API (no Temporal) and one operator token per role, for the operator tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from fastapi.testclient import TestClient

from gpucloud.api.app import create_app
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.models.operator_roles import Role
from gpucloud.services import operators


@contextmanager
def operator_api(tmp_path: Path) -> Iterator[tuple[TestClient, Settings]]:
    settings = Settings(data_dir=tmp_path)
    app = create_app(settings, temporal=object())  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, settings


def role_token(settings: Settings, name: str, role: Role, *, lifetime: timedelta = timedelta(days=1)) -> str:
    with session_scope(settings.database_url) as session:
        return operators.create(session, name, role, created_by="operator:bootstrap", lifetime=lifetime)[2]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
