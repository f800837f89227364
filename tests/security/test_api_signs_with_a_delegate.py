"""Issue 37 item 8: the issuer's signing key lives with the workers, not in the internet-facing
API processes. An API process holds a delegate: its own key and a certificate the issuer key
signed for it, which lets it mint ledger tokens only (`web/service_tokens.py`).

Before: `create_app` loaded (or created) the issuer key itself, so an API process taken over
could mint a token for any node's agent, the tracker or a swarm.
"""

from __future__ import annotations

import time
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from fastapi.testclient import TestClient

from gpucloud import bootstrap
from gpucloud.api.app import create_app
from gpucloud.config import Settings
from gpucloud.devstack.stack import Stack
from gpucloud.web.service_tokens import (
    LEDGER_AUDIENCE,
    LEEWAY_S,
    SWARM_MEMBER,
    TRACKER_AUDIENCE,
    InvalidToken,
    Issuer,
    Verifier,
    agent_audience,
    issue_delegate,
    load_delegate,
)

pytestmark = pytest.mark.integration

ROOT = Issuer(Ed25519PrivateKey.generate())
VERIFIER = Verifier(ROOT.public_key)
API_SCOPE = {"name": "api", "audiences": (LEDGER_AUDIENCE,), "roles": ("agent", "operator", "control-plane")}


def raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def delegate_of(root: Issuer, *, ttl_s: float = 3600.0) -> Issuer:
    key = Ed25519PrivateKey.generate()
    return Issuer(key, certificate=root.certify(key.public_key(), ttl_s=ttl_s, **API_SCOPE))  # type: ignore[arg-type]


def test_a_delegate_token_for_an_audience_and_role_its_certificate_allows_verifies() -> None:
    token = delegate_of(ROOT).mint(LEDGER_AUDIENCE, subject="node:gpu-1", role="agent")
    claims = VERIFIER.verify(token, audience=LEDGER_AUDIENCE, roles=("agent",))
    assert (claims.subject, claims.role) == ("node:gpu-1", "agent")


@pytest.mark.parametrize(
    ("audience", "role"),
    [
        (agent_audience("gpu-1"), "control-plane"),  # drive a node's agent (wipe, provision)
        (TRACKER_AUDIENCE, "control-plane"),
        (LEDGER_AUDIENCE, SWARM_MEMBER),  # an audience it may mint for, in a role it may not
    ],
)
def test_a_delegate_token_outside_its_certificate_is_refused(audience: str, role: str) -> None:
    token = delegate_of(ROOT).mint(audience, role=role)
    with pytest.raises(InvalidToken, match="certificate does not allow"):
        VERIFIER.verify(token, audience=audience, roles=(role,))


def test_a_delegate_token_whose_certificate_expired_is_refused() -> None:
    token = delegate_of(ROOT, ttl_s=-(LEEWAY_S + 60)).mint(LEDGER_AUDIENCE)
    with pytest.raises(InvalidToken, match="delegate certificate: Signature has expired"):
        VERIFIER.verify(token, audience=LEDGER_AUDIENCE)


def test_a_verified_delegate_token_lasts_no_longer_than_its_certificate() -> None:
    token = delegate_of(ROOT, ttl_s=60).mint(LEDGER_AUDIENCE)  # the token itself lives 300 s
    assert VERIFIER.verify(token, audience=LEDGER_AUDIENCE).expires_at <= time.time() + 61


def test_a_certificate_signed_by_another_key_is_refused() -> None:
    token = delegate_of(Issuer(Ed25519PrivateKey.generate())).mint(LEDGER_AUDIENCE)
    with pytest.raises(InvalidToken, match="delegate certificate: Signature verification failed"):
        VERIFIER.verify(token, audience=LEDGER_AUDIENCE)


def test_a_delegate_cannot_certify_a_key_and_its_certificate_is_no_token() -> None:
    delegate_key = Ed25519PrivateKey.generate()
    delegate = Issuer(delegate_key, certificate=ROOT.certify(delegate_key.public_key(), ttl_s=60, **API_SCOPE))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="only the issuer key"):
        delegate.certify(Ed25519PrivateKey.generate().public_key(), ttl_s=60, **API_SCOPE)  # type: ignore[arg-type]
    # Its key certifying another key anyway: that certificate does not verify against the issuer's.
    key = Ed25519PrivateKey.generate()
    forged = Issuer(delegate_key).certify(key.public_key(), ttl_s=60, **API_SCOPE)  # type: ignore[arg-type]
    with pytest.raises(InvalidToken, match="delegate certificate: Signature verification failed"):
        VERIFIER.verify(Issuer(key, certificate=forged).mint(LEDGER_AUDIENCE), audience=LEDGER_AUDIENCE)
    with pytest.raises(InvalidToken, match="Audience doesn't match"):  # signed by the issuer key, for no server
        VERIFIER.verify(delegate.certificate or "", audience=LEDGER_AUDIENCE)


def test_a_delegate_file_keeps_the_key_and_certificate_and_an_expired_one_is_refused(tmp_path) -> None:
    path = tmp_path / "api_delegate.pem"
    issue_delegate(ROOT, path, ttl_s=3600, **API_SCOPE)  # type: ignore[arg-type]
    assert path.stat().st_mode & 0o077 == 0
    token = load_delegate(path).mint(LEDGER_AUDIENCE, role="operator")
    assert VERIFIER.verify(token, audience=LEDGER_AUDIENCE, roles=("operator",)).role == "operator"
    issue_delegate(ROOT, path, ttl_s=-1, **API_SCOPE)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expired; issue a new one"):
        load_delegate(path)


def _settings(tmp_path, **api) -> Settings:
    return Settings(data_dir=tmp_path, ledger={"url": "http://127.0.0.1:9"}, api={"operator_token": "op", **api})


def test_the_api_built_as_up_builds_it_signs_with_its_delegate_and_never_reads_the_issuer_key(
    tmp_path, monkeypatch
) -> None:
    settings = _settings(tmp_path)
    bootstrap.issue_api_delegate(settings)  # what `gpucloud up` does before it starts the API
    root_public = bootstrap.token_issuer(settings).public_key
    settings.issuer_key_path.unlink()  # the API host has no issuer key file...

    def no_issuer_key(_settings):
        raise AssertionError("the API process asked for the issuer key")

    monkeypatch.setattr(bootstrap, "token_issuer", no_issuer_key)  # ...and never asks for it
    app = create_app(settings, temporal=object())  # type: ignore[arg-type]
    assert raw(app.state.issuer.public_key) != raw(root_public) and app.state.issuer.certificate is not None
    assert app.state.ledger._issuer is app.state.issuer
    with TestClient(app) as client:
        answer = client.post("/v1/agents/ledger-token", headers={"Authorization": "Bearer op"})
    assert answer.status_code == 200, answer.text
    token = answer.json()["token"]
    assert Verifier(root_public).verify(token, audience=LEDGER_AUDIENCE, roles=("operator",)).role == "operator"
    with pytest.raises(jwt.InvalidSignatureError):  # signed by the delegate, not the issuer key
        jwt.decode(token, root_public, algorithms=["EdDSA"], audience=LEDGER_AUDIENCE)
    assert not settings.issuer_key_path.exists()


def test_an_api_without_a_delegate_refuses_to_sign(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"no delegate key at .*gpucloud issue-delegate"):
        create_app(_settings(tmp_path), temporal=object())  # type: ignore[arg-type]
    app = create_app(Settings(data_dir=tmp_path, api={"operator_token": "op"}), temporal=object())  # type: ignore[arg-type]
    with TestClient(app) as client:
        answer = client.post("/v1/agents/ledger-token", headers={"Authorization": "Bearer op"})
    assert answer.status_code == 501 and "issue-delegate" in answer.json()["detail"]
    assert not (tmp_path / "issuer_key.pem").exists()


def test_up_gives_the_api_process_the_delegate_and_not_the_issuer_key_path(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GPUCLOUD_AGENT__ISSUER_KEY", str(tmp_path / "issuer_key.pem"))
    stack = Stack(Settings(data_dir=tmp_path))
    spawned: dict = {}
    # Started afresh or forked (`devstack/forked.py`): the environment it is given is what counts.
    monkeypatch.setattr(stack, "_spawn", lambda name, args, *, env=None: spawned.update(env=env))
    monkeypatch.setattr(stack, "_spawn_cli", lambda name, *args, env=None: spawned.update(env=env))
    monkeypatch.setattr(stack, "_wait", lambda *args: None)
    stack._start_api(lambda _step: None)
    env = spawned["env"]
    assert "GPUCLOUD_AGENT__ISSUER_KEY" not in env
    api = load_delegate(Path(env["GPUCLOUD_API__DELEGATE_KEY"]))
    root = Verifier(bootstrap.token_issuer(stack.settings).public_key)
    assert root.verify(api.mint(LEDGER_AUDIENCE), audience=LEDGER_AUDIENCE).role == "control-plane"


def test_issue_delegate_writes_what_an_api_host_is_given(tmp_path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from gpucloud.cli.main import app

    monkeypatch.setenv("GPUCLOUD_DATA_DIR", str(tmp_path))
    out = tmp_path / "for-the-api-host.pem"
    done = CliRunner().invoke(app, ["issue-delegate", "--out", str(out), "--valid-for", "2h"])
    assert done.exit_code == 0, done.output
    delegate = load_delegate(out)
    root = Verifier(bootstrap.token_issuer(Settings(data_dir=tmp_path)).public_key)
    assert root.verify(delegate.mint(LEDGER_AUDIENCE), audience=LEDGER_AUDIENCE).role == "control-plane"
    certificate = jwt.decode(delegate.certificate or "", options={"verify_signature": False})
    assert abs(certificate["exp"] - (time.time() + 7200)) < 60
    assert raw(delegate.public_key) != raw(bootstrap.token_issuer(Settings(data_dir=tmp_path)).public_key)


def test_the_tracker_holds_the_issuer_keys_public_half_only(tmp_path, monkeypatch) -> None:
    from gpucloud.entrypoints.tracker import create_deployment_tracker

    settings = Settings(data_dir=tmp_path)
    deployment = bootstrap.token_issuer(settings)  # made on a worker host; the tracker gets .pub
    settings.issuer_key_path.unlink()
    monkeypatch.setattr(bootstrap, "token_issuer", lambda _settings: pytest.fail("the tracker read the issuer key"))
    app = create_deployment_tracker(settings)
    with TestClient(app) as client:
        for issuer, refused in ((deployment, False), (ROOT, True)):
            headers = {"Authorization": f"Bearer {issuer.mint(TRACKER_AUDIENCE)}"}
            assert (client.post("/tracker/swarms", headers=headers, json={}).status_code == 401) is refused
    assert not settings.issuer_key_path.exists()


def test_a_new_delegate_file_is_taken_up_without_a_restart_and_readiness_names_an_expired_one(tmp_path) -> None:
    """`gpucloud prepare` renews the delegate before its certificate ends; the running API signs
    with the new one within seconds. One left to run out makes the API not ready, saying what to do."""
    import asyncio
    import os

    from gpucloud.web.readiness import delegate_check
    from gpucloud.web.service_tokens import DelegateFile

    path = tmp_path / "api_delegate.pem"
    issue_delegate(ROOT, path, ttl_s=3600, **API_SCOPE)  # type: ignore[arg-type]
    delegate = DelegateFile(path, check_every_s=0)
    first = jwt.get_unverified_header(delegate.mint(LEDGER_AUDIENCE, role="operator"))
    asyncio.run(delegate_check(delegate)())  # not expired: ready
    issue_delegate(ROOT, path, ttl_s=2, **API_SCOPE)  # type: ignore[arg-type]
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1_000_000))  # the same second's write, seen as new
    renewed = delegate.mint(LEDGER_AUDIENCE, role="agent")
    assert jwt.get_unverified_header(renewed) != first
    assert VERIFIER.verify(renewed, audience=LEDGER_AUDIENCE, roles=("agent",)).role == "agent"
    time.sleep(2.1)
    with pytest.raises(RuntimeError, match=r"delegate certificate .* expired: run `gpucloud prepare`"):
        asyncio.run(delegate_check(delegate)())
    path.write_text("half-written")  # an unreadable file keeps the one it has
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 2_000_000))
    assert delegate.certificate is not None
