"""The console's plain-HTTP test steps, shared by tests/console/test_console_*pages.py: a form's
hidden field, signing in with a token or key (a fresh session each time), a tenant made in the
database, and a page's text without its markup."""

from __future__ import annotations

import re
from html import unescape

from fastapi.testclient import TestClient

from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.models.tables import TenantQuotaBase
from gpucloud.services import tenants


def hidden(html: str, name: str = "csrf_token") -> str:
    found = re.search(rf'name="{name}" value="([^"]*)"', html)
    assert found, f"no hidden field {name}"
    return found.group(1)


def sign_in(client: TestClient, token: str) -> str:
    """Sign in (dropping any session the client held); the CSRF token of the page it lands on."""
    client.cookies.clear()
    form = client.get("/console/sign-in")
    answer = client.post("/console/sign-in", data={"csrf_token": hidden(form.text), "token": token, "next": ""})
    assert answer.status_code == 303, answer.text
    return hidden(client.get(answer.headers["location"]).text)


def make_tenant(settings: Settings, name: str = "acme") -> tuple[str, str, str]:
    """A tenant with an H100 quota in r1: its id, its first key's id and the key."""
    with session_scope(settings.database_url) as session:
        tenant, _, key, plaintext = tenants.create(
            session, name=name, quotas=[TenantQuotaBase(gpu_type="H100", region="r1", max_gpus=64)], actor="test"
        )
        return tenant.id, key.id, plaintext


def text(html: str) -> str:
    return re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", " ", html)))
