"""The console's tenant pages beyond the first ones, over plain HTTP (no browser, no Temporal): a
model's versions with their evaluations, verdicts and promotions, and a promote that goes through
the API's service and refuses what the API refuses, in its words."""

from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime, timedelta
from html import unescape
from html.parser import HTMLParser

import pytest
from fastapi.testclient import TestClient
from sqlmodel import select

from gpucloud.api.app import create_app
from gpucloud.config import Settings
from gpucloud.console import allocations as console_allocations
from gpucloud.db import session_scope
from gpucloud.health.breaker import OperatorAlert
from gpucloud.models.health_tables import Incident
from gpucloud.models.incident_messages import IncidentInput
from gpucloud.models.registry_tables import (
    EvaluationResult,
    EvaluationSource,
    GateSpec,
    ModelAlias,
    ModelVersion,
    RegistryModel,
    SigningKey,
)
from gpucloud.models.tables import Allocation, Node
from gpucloud.registry import promotion
from gpucloud.services import fleet_kind_incidents, incidents
from support.console import make_tenant as _tenant
from support.console import sign_in as _sign_in
from support.console import text as _text
from support.nodes import enroll
from support.operators import bearer

# On every database: the lists' keyset pages and the promote's row lock are the database's.
pytestmark = pytest.mark.integration

OPERATOR_TOKEN = "console-tenant-pages-operator-token"
KEY_ID = "k" * 64


@pytest.fixture
def settings(tmp_path, db_url) -> Settings:
    return Settings(
        data_dir=tmp_path, database={"url": db_url}, api={"operator_token": OPERATOR_TOKEN, "credential_cache_s": 0}
    )


@pytest.fixture
def client(settings):
    app = create_app(settings, temporal=object())  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False, follow_redirects=False) as c:
        yield c


class _Controls(HTMLParser):
    """Every form control of a page, and the ids its labels name or the controls they hold."""

    def __init__(self) -> None:
        super().__init__()
        self.controls: list[dict[str, str | None]] = []
        self.labelled: set[str] = set()
        self.in_label = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "label":
            self.in_label += 1
            if found.get("for"):
                self.labelled.add(found["for"] or "")
        elif tag in ("input", "select", "textarea") and found.get("type") != "hidden":
            self.controls.append({**found, "wrapped": "yes" if self.in_label else None})

    def handle_endtag(self, tag: str) -> None:
        if tag == "label":
            self.in_label -= 1


def unlabelled(html: str) -> list[dict[str, str | None]]:
    """The controls of a page no label names, holds, or `aria-label`s."""
    parser = _Controls()
    parser.feed(html)
    return [
        c
        for c in parser.controls
        if not c["wrapped"] and not c.get("aria-label") and (c.get("id") or "") not in parser.labelled
    ]


# ---------------------------------------------------------------- models: evaluations and promotions


def _digest(n: int) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()


def _model(settings: Settings, tenant_id: str) -> tuple[str, str, str]:
    """A model gated on accuracy >= 0.8, with a good version (sanity and command passed) and a
    bad one (accuracy 0.5); (model name, good digest, bad digest)."""
    good, bad = _digest(1), _digest(2)
    now = datetime.now(UTC)
    with session_scope(settings.database_url) as session:
        model = RegistryModel(tenant_id=tenant_id, name="llama")
        session.add(model)
        session.flush()
        promotion.replace_gates(session, model, [GateSpec(metric="accuracy", min=0.8)])
        session.add(SigningKey(tenant_id=tenant_id, key_id=KEY_ID, public_key="0" * 64))
        for digest in (good, bad):
            session.add(
                ModelVersion(
                    digest=digest,
                    tenant_id=tenant_id,
                    model_id=model.id,
                    total_size=1000,
                    chunk_count=1,
                    file_count=1,
                    key_id=KEY_ID,
                    created_at=now,
                    manifest_uri=f"file:///{digest}",
                )
            )
        for i, (digest, evaluator, results) in enumerate(
            [
                (good, "sanity", {"nan_inf_count": 0.0}),
                (good, "command", {"accuracy": 0.91}),
                (bad, "sanity", {"nan_inf_count": 0.0}),
                (bad, "command", {"accuracy": 0.5}),
            ]
        ):
            session.add(
                EvaluationResult(
                    tenant_id=tenant_id,
                    version=digest,
                    evaluator=evaluator,
                    results=results,
                    recorded_at=now - timedelta(minutes=10 - i),
                    record_digest=_digest(100 + i),
                    key_id="p" * 64,
                    signature="s" * 128,
                    source=EvaluationSource.PLATFORM,
                )
            )
    return "llama", good, bad


def test_a_models_versions_show_their_evaluations_verdicts_and_promotions(client, settings):
    tenant_id, key_id, key = _tenant(settings)
    name, good, bad = _model(settings, tenant_id)
    moved = client.put(f"/v1/models/{name}/aliases/staging", json={"version": good}, headers=bearer(key))
    assert moved.status_code == 200, moved.text
    _sign_in(client, key)
    page = client.get(f"/console/models/{name}")
    assert page.status_code == 200
    rows = {d: _text(page.text.split(f'id="version-{d[:12]}"')[1].split("</tr>")[0]) for d in (good, bad)}
    # The promotion: which alias, since when, by whom (the key that moved it, in the API too).
    assert "staging since" in rows[good] and f"by tenant:{tenant_id}/key:{key_id}" in rows[good]
    assert "staging since" not in rows[bad]
    # Each version's platform evaluations and its verdict for staging and production.
    assert "sanity: ran" in rows[good] and "command: ran" in rows[good]
    assert "staging: passes" in rows[good] and "production: passes" in rows[good]
    assert "staging: refused (accuracy (command)=0.5: below the minimum 0.8)" in rows[bad]
    # One version's evaluations, and the gates against it with their thresholds and values.
    chosen = client.get(f"/console/models/{name}?version={bad}")
    gates = _text(chosen.text.split('id="gates"')[1].split("</table>")[0])
    assert "accuracy command at least 0.8 0.5 fails: below the minimum 0.8" in gates
    evaluations = _text(chosen.text.split('id="evaluations"')[1].split("</table>")[0])
    assert "command platform done accuracy: 0.5" in evaluations
    assert unlabelled(chosen.text) == []
    # A version signed by a key since revoked moves nowhere gated, and says why.
    with session_scope(settings.database_url) as session:
        signing_key = session.exec(select(SigningKey).where(SigningKey.key_id == KEY_ID)).one()
        signing_key.revoked_at = datetime.now(UTC)
        session.add(signing_key)
    revoked = client.get(f"/console/models/{name}").text
    row = _text(revoked.split(f'id="version-{good[:12]}"')[1].split("</tr>")[0])
    assert f"staging: refused (version {good} was signed by key {KEY_ID}, which is no longer trusted)" in row


def test_promote_goes_through_the_apis_service_and_refuses_what_it_refuses(client, settings):
    tenant_id, key_id, key = _tenant(settings)
    name, good, bad = _model(settings, tenant_id)
    csrf = _sign_in(client, key)
    unconfirmed = client.post(
        f"/console/models/{name}/promote", data={"csrf_token": csrf, "version": good, "alias": "production"}
    )
    assert unconfirmed.status_code == 422 and 'id="promote-confirm-error"' in unconfirmed.text
    bad_alias = client.post(
        f"/console/models/{name}/promote",
        data={"csrf_token": csrf, "version": good, "alias": "prod", "confirm": "yes"},
    )
    assert bad_alias.status_code == 422 and 'id="promote-alias-error"' in bad_alias.text
    forged = client.post(
        f"/console/models/{name}/promote", data={"csrf_token": "nope", "version": good, "alias": "production"}
    )
    assert forged.status_code == 403
    # The gates refuse the bad version: the console says what the API says, word for word.
    refused = client.post(
        f"/console/models/{name}/promote",
        data={"csrf_token": csrf, "version": bad, "alias": "production", "confirm": "yes"},
    )
    api = client.put(f"/v1/models/{name}/aliases/production", json={"version": bad}, headers=bearer(key))
    assert refused.status_code == 409 and api.status_code == 409
    assert api.json()["detail"] in _text(refused.text)
    with session_scope(settings.database_url) as session:
        assert session.exec(select(ModelAlias).where(ModelAlias.name == "production")).first() is None
    done = client.post(
        f"/console/models/{name}/promote",
        data={"csrf_token": csrf, "version": good, "alias": "production", "confirm": "yes"},
    )
    assert done.status_code == 303 and done.headers["location"].endswith(f"?version={good}&done=promote")
    with session_scope(settings.database_url) as session:
        alias = session.exec(select(ModelAlias).where(ModelAlias.name == "production")).one()
        assert alias.version == good and alias.moved_by == f"tenant:{tenant_id}/key:{key_id}"
    assert client.get(f"/v1/models/{name}/versions/production", headers=bearer(key)).json()["digest"] == good
    # Another tenant's model is a 404, as in the API.
    _, _, other = _tenant(settings, "globex")
    client.cookies.clear()
    other_csrf = _sign_in(client, other)
    foreign = client.post(
        f"/console/models/{name}/promote",
        data={"csrf_token": other_csrf, "version": good, "alias": "candidate", "confirm": "yes"},
    )
    assert foreign.status_code == 404


# ---------------------------------------------------------------- allocations, a page at a time


def _allocations(settings: Settings, tenant_id: str, count: int, *, region: str = "r1") -> set[str]:
    with session_scope(settings.database_url) as session:
        rows = [Allocation(tenant_id=tenant_id, gpu_type="H100", region=region, node_count=1) for _ in range(count)]
        session.add_all(rows)
        return {a.id for a in rows}


def _walk(client: TestClient, first: str, *, between=None) -> list[str]:
    """Every allocation id the pages list, following "Next" from `first`; `between` runs after
    each page (rows made while someone pages)."""
    seen: list[str] = []
    url: str | None = first
    while url is not None:
        page = client.get(url)
        assert page.status_code == 200, page.text[:500]
        table = page.text.split("<tbody>")[1].split("</tbody>")[0]
        seen += re.findall(r'href="/console/allocations/(alloc_[^"/]+)"', table)
        found = re.search(r'<a href="([^"]+)" rel="next">', page.text)
        url = unescape(found.group(1)) if found else None
        if between is not None:
            between()
    return seen


def test_allocation_lists_page_with_the_apis_cursor_and_list_each_row_once(client, settings):
    size = console_allocations.PAGE_SIZE
    tenant_id, _, key = _tenant(settings)
    other_id, _, _ = _tenant(settings, "globex")
    mine = _allocations(settings, tenant_id, 2 * size + 3)
    theirs = _allocations(settings, other_id, 5, region="r2")
    _sign_in(client, key)
    made_meanwhile: set[str] = set()
    listed = _walk(
        client, "/console/allocations", between=lambda: made_meanwhile.update(_allocations(settings, tenant_id, 2))
    )
    # Two pages and a bit: three pages, each row once, newest first; what was made while paging
    # comes before the first page, and never shifts a row onto a later one.
    assert len(listed) == len(set(listed)) == 2 * size + 3 and set(listed) == mine
    seqs = _seqs(settings)
    assert listed == sorted(listed, key=seqs.__getitem__, reverse=True)
    assert not made_meanwhile & set(listed)
    client.cookies.clear()
    _sign_in(client, OPERATOR_TOKEN)
    everyone = _walk(client, "/console/allocations")
    assert len(everyone) == len(set(everyone)) and set(everyone) == mine | theirs | made_meanwhile
    # The filters travel with the cursor (the token is bound to them, as in the API).
    filtered = _walk(client, f"/console/allocations?tenant={tenant_id}&region=r1")
    assert set(filtered) == mine | made_meanwhile and len(filtered) == len(set(filtered))
    first = client.get(f"/console/allocations?tenant={tenant_id}")
    token = re.search(r'page_token=([^"&]+)"', first.text)
    assert token
    replayed = client.get(f"/console/allocations?tenant={other_id}&page_token={token.group(1)}")
    assert replayed.status_code == 400 and "filters changed" in replayed.text
    assert client.get("/console/allocations?page_token=forged").status_code == 400


def _seqs(settings: Settings) -> dict[str, int]:
    with session_scope(settings.database_url) as session:
        return dict(session.exec(select(Allocation.id, Allocation.seq)).all())


# ---------------------------------------------------------------- API keys: the create form


def test_the_key_create_form_is_the_apis_create_labelled_and_refused_in_its_words(tmp_path, db_url):
    settings = Settings(
        data_dir=tmp_path,
        database={"url": db_url},
        api={"operator_token": OPERATOR_TOKEN, "credential_cache_s": 0, "max_api_keys_per_tenant": 2},
    )
    app = create_app(settings, temporal=object())  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False, follow_redirects=False) as client:
        _, _, key = _tenant(settings)
        csrf = _sign_in(client, key)
        listing = client.get("/console/api-keys")
        assert unlabelled(listing.text) == []
        assert "holds 1 of the 2 live keys" in _text(listing.text)
        created = client.post("/console/api-keys", data={"csrf_token": csrf})
        assert created.status_code == 201 and unlabelled(created.text) == []
        assert "holds 2 of the 2 live keys it may hold: revoke one" in _text(created.text)
        # At the cap: the API's refusal, in its words, beside the create form.
        refused = client.post("/console/api-keys", data={"csrf_token": csrf})
        api = client.post("/v1/api-keys", headers=bearer(key))
        assert refused.status_code == 409 and api.status_code == 409
        beside = refused.text.split('id="create-refused">')[1].split("</p>")[0]
        assert api.json()["detail"] in _text(beside)


# ---------------------------------------------------------------- incidents: the operator's resolve


def test_the_console_resolves_a_fleet_incident_through_the_apis_resolve(client, settings):
    node_id, other_node = enroll(settings.database_url, ["n0101", "n0102"])
    now = datetime.now(UTC)
    with session_scope(settings.database_url) as session:
        node_incident = incidents.open_incident(
            session, workflow_id="incident-n0101", inp=IncidentInput(node_id=node_id, detected_at=now)
        ).id
        alert = OperatorAlert(
            pool="H100/r1",
            node_id=other_node,
            pulled_in_window=3,
            pool_size=4,
            max_pulled_share=0.5,
            window=timedelta(hours=1),
            at=now,
            reason="3 of 4 nodes pulled in 1h",
        )
        trip = fleet_kind_incidents.for_trip(
            session, session.get(Node, other_node), alert, tenant=None, window_start=now, now=now
        ).id
    csrf = _sign_in(client, OPERATOR_TOKEN)
    assert 'action="/console/incidents/' + trip + '/resolve"' in client.get(f"/console/incidents/{trip}").text
    assert "/resolve" not in client.get(f"/console/incidents/{node_incident}").text
    unconfirmed = client.post(f"/console/incidents/{trip}/resolve", data={"csrf_token": csrf, "note": "x"})
    assert unconfirmed.status_code == 422 and 'id="resolve-confirm-error"' in unconfirmed.text
    too_long = client.post(
        f"/console/incidents/{trip}/resolve", data={"csrf_token": csrf, "note": "x" * 1001, "confirm": "yes"}
    )
    assert too_long.status_code == 422 and 'id="resolve-note-error"' in too_long.text
    # A node's incident: refused as the API refuses it, in its words.
    refused = client.post(
        f"/console/incidents/{node_incident}/resolve", data={"csrf_token": csrf, "note": "x", "confirm": "yes"}
    )
    api = client.post(f"/v1/incidents/{node_incident}:resolve", headers=bearer(OPERATOR_TOKEN))
    assert refused.status_code == 409 and api.status_code == 409
    assert api.json()["detail"] in _text(refused.text.split('id="resolve-refused">')[1].split("</p>")[0])
    missing = client.post("/console/incidents/inc_nope/resolve", data={"csrf_token": csrf, "confirm": "yes"})
    assert missing.status_code == 404
    done = client.post(
        f"/console/incidents/{trip}/resolve",
        data={"csrf_token": csrf, "note": "pool drained by a bad image", "confirm": "yes"},
    )
    assert done.status_code == 303 and done.headers["location"].endswith("?done=resolve")
    with session_scope(settings.database_url) as session:
        detail = session.exec(select(Incident).where(Incident.id == trip)).one().detail
    assert (detail["resolved_by"], detail["resolution"]) == ("operator:bootstrap", "pool drained by a bad image")
    assert "Resolved." in client.get(done.headers["location"]).text
    # A tenant may not resolve one.
    client.cookies.clear()
    _, _, key = _tenant(settings)
    tenant_csrf = _sign_in(client, key)
    forbidden = client.post(f"/console/incidents/{trip}/resolve", data={"csrf_token": tenant_csrf, "confirm": "yes"})
    assert forbidden.status_code == 403
