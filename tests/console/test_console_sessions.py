"""The console's sessions over plain HTTP (no browser): the cookie holds a random session id and
nothing else (HttpOnly, SameSite=Strict, Secure over TLS), the credential stays on the server,
every POST needs the session's CSRF token, revoking the key ends the session, and sign-out
deletes it. In process: the API app, with a stand-in for Temporal (nothing here starts one)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlmodel import select

from gpucloud.api.app import create_app
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.models.tables import ConsoleSession, TenantQuotaBase
from gpucloud.services import tenants
from support.operators import bearer

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

OPERATOR_TOKEN = "console-test-operator-token"


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(data_dir=tmp_path, api={"operator_token": OPERATOR_TOKEN, "credential_cache_s": 0})


def _client(settings: Settings, base_url: str = "http://testserver") -> TestClient:
    app = create_app(settings, temporal=object())  # type: ignore[arg-type]
    return TestClient(app, base_url=base_url, raise_server_exceptions=False, follow_redirects=False)


@pytest.fixture
def client(settings) -> Iterator[TestClient]:
    with _client(settings) as c:
        yield c


def _hidden(html: str, name: str) -> str:
    found = re.search(rf'name="{name}" value="([^"]*)"', html)
    assert found, f"no hidden field {name}"
    return found.group(1)


def _sign_in(client: TestClient, token: str):
    form = client.get("/console/sign-in")
    assert form.status_code == 200
    return client.post(
        "/console/sign-in", data={"csrf_token": _hidden(form.text, "csrf_token"), "token": token, "next": ""}
    )


def _set_cookie(response, name: str) -> str:
    headers = [v for k, v in response.headers.multi_items() if k.lower() == "set-cookie" and v.startswith(f"{name}=")]
    assert len(headers) == 1, response.headers
    return headers[0]


def _tenant_key(settings: Settings) -> tuple[str, str, str]:
    with session_scope(settings.database_url) as session:
        tenant, _, key, plaintext = tenants.create(
            session, name="acme", quotas=[TenantQuotaBase(gpu_type="*", region="*", max_gpus=64)], actor="test"
        )
        return tenant.id, key.id, plaintext


def test_a_page_asks_a_visitor_to_sign_in_first(client):
    answer = client.get("/console/fleet")
    assert answer.status_code == 303
    assert answer.headers["location"] == "/console/sign-in?next=/console/fleet"


def test_the_page_a_visitor_asked_for_is_kept_whole_in_the_sign_in_link(client):
    """A node id with `&` in it is part of the page to come back to, not a new parameter."""
    answer = client.get("/console/nodes/gpu%26a")
    assert answer.status_code == 303
    assert answer.headers["location"] == "/console/sign-in?next=/console/nodes/gpu%26a"


def test_the_fleet_stream_takes_a_time_without_a_zone_as_utc(client, settings):
    """`since` (or `Last-Event-ID`) without a zone: the stream starts from it, as UTC, and sends
    the nodes that changed after it, instead of ending at its first comparison."""
    from support.nodes import enroll

    enroll(settings.database_url, ["n-naive"])
    assert _sign_in(client, OPERATOR_TOKEN).status_code == 303
    for query, headers in (("?since=2020-01-01T00:00:00", {}), ("", {"Last-Event-ID": "2020-01-01T00:00:00"})):
        with client.stream("GET", f"/console/fleet/events{query}", headers=headers) as stream:
            assert stream.status_code == 200
            lines = []
            for line in stream.iter_lines():
                lines.append(line)
                if line.startswith("data: ") or len(lines) > 10:
                    break
        assert "event: nodes" in lines and "n-naive" in lines[-1], lines


def test_a_visitors_sign_out_is_sent_to_sign_in_before_its_form_is_read(client):
    sent = client.post("/console/sign-out", data={"csrf_token": "anything"})
    assert sent.status_code == 303 and sent.headers["location"] == "/console/sign-in"


def test_the_cookie_holds_a_random_session_id_and_the_credential_stays_on_the_server(client, settings):
    signed_in = _sign_in(client, OPERATOR_TOKEN)
    assert signed_in.status_code == 303 and signed_in.headers["location"] == "/console/fleet"
    cookie = _set_cookie(signed_in, "gpucloud_console")
    attributes = {part.strip().split("=")[0].lower() for part in cookie.split(";")[1:]}
    assert {"httponly", "path", "max-age"} <= attributes and "secure" not in attributes  # plain HTTP
    assert "samesite=strict" in cookie.lower() and "path=/console" in cookie.lower()
    session_id = cookie.split(";")[0].split("=", 1)[1]
    assert OPERATOR_TOKEN not in cookie and len(session_id) >= 40
    with session_scope(settings.database_url) as session:
        rows = session.exec(select(ConsoleSession)).all()
    assert len(rows) == 1
    stored = " ".join(str(v) for v in rows[0].model_dump().values())
    assert session_id not in stored and OPERATOR_TOKEN not in stored
    assert rows[0].role == "operator" and rows[0].credential_id == "bootstrap"
    page = client.get("/console/fleet")
    assert page.status_code == 200 and "Signed in as" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]


def test_over_tls_the_cookie_is_secure(settings):
    with _client(settings, base_url="https://testserver") as client:
        cookie = _set_cookie(_sign_in(client, OPERATOR_TOKEN), "gpucloud_console")
    assert "secure" in {part.strip().lower() for part in cookie.split(";")}


def test_a_wrong_credential_opens_no_session(client, settings):
    refused = _sign_in(client, "gpc_key_nope.secret")
    assert refused.status_code == 401 and "not a live operator token or tenant API key" in refused.text
    assert "gpucloud_console=" not in refused.headers.get("set-cookie", "")
    with session_scope(settings.database_url) as session:
        assert session.exec(select(ConsoleSession)).all() == []


def test_a_post_without_the_csrf_token_is_refused(client):
    form = client.get("/console/sign-in")
    no_token = client.post("/console/sign-in", data={"token": OPERATOR_TOKEN})
    assert no_token.status_code == 403 and "CSRF" in no_token.text
    assert _hidden(form.text, "csrf_token")
    assert _sign_in(client, OPERATOR_TOKEN).status_code == 303
    page = client.get("/console/fleet")
    csrf = _hidden(page.text, "csrf_token")
    for path in ("/console/sign-out", "/console/nodes/n1/cordon"):
        assert client.post(path, data={"reason": "x", "confirm": "yes"}).status_code == 403, path
        forged = client.post(path, data={"csrf_token": csrf[::-1], "reason": "x", "confirm": "yes"})
        assert forged.status_code == 403, path
    assert client.get("/console/fleet").status_code == 200  # still signed in


def test_revoking_the_key_ends_the_session(client, settings):
    tenant_id, key_id, key = _tenant_key(settings)
    assert _sign_in(client, key).headers["location"] == "/console/allocations"
    assert client.get("/console/allocations").status_code == 200
    revoked = client.delete(f"/v1/tenants/{tenant_id}/api-keys/{key_id}", headers=bearer(OPERATOR_TOKEN))
    assert revoked.status_code == 200, revoked.text
    assert client.get("/console/allocations").status_code == 303


def test_sign_out_deletes_the_session(client, settings):
    _sign_in(client, OPERATOR_TOKEN)
    cookie = client.cookies.get("gpucloud_console")
    csrf = _hidden(client.get("/console/fleet").text, "csrf_token")
    out = client.post("/console/sign-out", data={"csrf_token": csrf})
    assert out.status_code == 303 and out.headers["location"] == "/console/sign-in"
    with session_scope(settings.database_url) as session:
        assert session.exec(select(ConsoleSession)).all() == []
    client.cookies.set("gpucloud_console", cookie, path="/console")  # the old cookie, replayed
    assert client.get("/console/fleet").status_code == 303


def test_a_tenant_sees_no_operator_page_and_an_operator_no_tenant_page(client, settings):
    _, _, key = _tenant_key(settings)
    _sign_in(client, key)
    assert client.get("/console/fleet").status_code == 403
    client.cookies.clear()
    _sign_in(client, OPERATOR_TOKEN)
    for path in ("/console/api-keys", "/console/usage", "/console/models"):
        assert client.get(path).status_code == 403, path


def test_the_fleet_map_reads_the_same_few_statements_at_any_fleet_size(client, settings):
    """One query of the cells (and one of the filters' choices), never one per node."""
    import sqlalchemy as sa

    from gpucloud.db import get_read_engine
    from support.nodes import enroll

    _sign_in(client, OPERATOR_TOKEN)
    statements: list[str] = []
    sa.event.listen(get_read_engine(settings.database_url), "before_cursor_execute", lambda *a: statements.append(a[2]))
    counts = []
    for first, count in ((0, 4), (4, 300)):
        enroll(settings.database_url, [f"n{i:04d}" for i in range(first, first + count)], rack=f"rack{first}")
        statements.clear()
        page = client.get("/console/fleet")
        assert page.status_code == 200 and page.text.count('id="n-n') == first + count
        counts.append(len(statements))
    assert counts[0] == counts[1] <= 3, counts


def test_only_a_cookie_shaped_like_a_session_id_costs_a_lookup(client, monkeypatch):
    """The gate looks a session up in the database only for a cookie shaped as the ones it issues
    (43 URL-safe characters), and never for a static file."""
    from gpucloud.services import console_sessions

    looked_up: list[str] = []
    real = console_sessions.find

    def counted(connection, session_id, **kwargs):
        looked_up.append(session_id)
        return real(connection, session_id, **kwargs)

    monkeypatch.setattr(console_sessions, "find", counted)
    for junk in ("x", "a" * 44, "a" * 42 + "!", "../" * 20):
        client.cookies.set("gpucloud_console", junk, path="/console")
        assert client.get("/console/fleet").status_code == 303
    assert looked_up == []
    shaped = "A" * 43
    client.cookies.set("gpucloud_console", shaped, path="/console")
    assert client.get("/console/static/console.css").status_code == 200
    assert looked_up == []
    assert client.get("/console/fleet").status_code == 303  # no such session: a visitor
    assert looked_up == [shaped]
