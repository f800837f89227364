"""Issue 13: no server of the stack answers a request without credentials, except `/healthz`,
`/readyz`, the OpenAPI document and the web console's door (its sign-in page and static files;
each of its other pages sends a visitor there).

Every route of every server (the API, the ledger, a node's agent, the tracker and origin, a
node's peer service, the simulated fleet and the simulated fabric managers) is called as an
attacker on the network would: no `Authorization` header, a body that does not validate, made-up
ids. Each must answer 401, so a route added later without a check fails here."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gpucloud.config import RequestBodySettings
from gpucloud.web.service_tokens import Verifier, load_or_create_issuer
from support.servers import SIGN_IN, calls, console_door, console_page, node_of, servers

pytestmark = [pytest.mark.integration, pytest.mark.one_database]


def _open_to_anyone(app: FastAPI, node_id: str = "n-1") -> list[str]:
    answered = []
    with TestClient(app, raise_server_exceptions=False) as client:
        for method, path in calls(app, node_id):
            if console_door(path):
                continue  # the console's sign-in page and its static files (`support/servers.py`)
            response = client.request(method, path, json={"garbage": True}, follow_redirects=False)
            if console_page(path):  # a visitor is sent to sign in, and shown nothing else
                location = response.headers.get("location", "")
                if response.status_code != 303 or location.partition("?")[0] != SIGN_IN:
                    answered.append(f"{method} {path} -> {response.status_code} {location}")
            elif response.status_code != 401:
                answered.append(f"{method} {path} -> {response.status_code}")
    return answered


@pytest.fixture
def verifier(tmp_path) -> Verifier:
    return Verifier(load_or_create_issuer(tmp_path / "issuer_key.pem").public_key)


def test_every_route_of_every_server_needs_credentials(tmp_path, db_url, verifier, temporal_env):
    apps = servers(tmp_path, db_url, verifier, temporal_env.client, RequestBodySettings())
    found = {name: _open_to_anyone(app, node_of(name)) for name, app in apps.items()}
    assert {name: answered for name, answered in found.items() if answered} == {}
    # The scan reached every server's routes (a server with none checked would pass vacuously).
    checked = {name: len(calls(app, "n-1")) for name, app in apps.items()}
    assert min(checked.values()) >= 1, checked
    assert checked["API"] > 50 and checked["ledger"] > 10, checked
    pages = [path for _, path in calls(apps["API"], "n-1") if console_page(path)]
    assert len(pages) > 30, pages  # the console's pages are among the API's routes walked


def test_health_and_the_openapi_document_stay_open(tmp_path, db_url, verifier, temporal_env):
    apps = servers(tmp_path, db_url, verifier, temporal_env.client, RequestBodySettings())
    with TestClient(apps["API"]) as api:
        assert api.get("/openapi.json").status_code == 200
    for name in ("tracker", "simulated fabric managers", "agent"):
        with TestClient(apps[name]) as client:
            assert client.get("/healthz").status_code == 200, name
