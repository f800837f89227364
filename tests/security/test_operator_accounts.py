"""Issue 37 item 8: named operators with their own tokens (hashed, expiring, rotated with a grace
period, revoked at once), and every operator action recorded under the operator's name.

Before: one static token, and node events said only `operator`."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlmodel import col, select

from gpucloud.db import session_scope
from gpucloud.models.operator_roles import Role
from gpucloud.models.tables import NodeTransition, OperatorToken
from gpucloud.services.api_keys import hash_secret
from support.nodes import enroll
from support.operators import bearer, operator_api, role_token

pytestmark = pytest.mark.integration


def test_an_admin_creates_rotates_and_revokes_operators(tmp_path) -> None:
    with operator_api(tmp_path) as (client, settings):
        admin = bearer(settings.operator_token)
        created = client.post("/v1/operators", headers=admin, json={"name": "alice", "role": "fleet-operator"})
        assert created.status_code == 201, created.text
        first = created.json()
        assert first["operator"]["created_by"] == "operator:bootstrap" and first["token"].startswith("gpo_")
        with session_scope(settings.database_url) as session:  # only the hash is kept
            stored = session.exec(select(OperatorToken)).one()
            assert stored.secret_hash == hash_secret(first["token"].split(".", 1)[1])
            assert first["token"] not in stored.model_dump_json()
        alice = bearer(first["token"])
        assert client.get("/v1/nodes", headers=alice).status_code == 200
        # Names mean one person: never reused, and `bootstrap` is the settings' admin's.
        for name in ("alice", "bootstrap"):
            again = client.post("/v1/operators", headers=admin, json={"name": name, "role": "admin"})
            assert again.status_code == 409, again.text
        # A fleet operator manages no operators.
        refused = client.post("/v1/operators", headers=alice, json={"name": "mallory", "role": "admin"})
        assert refused.status_code == 403 and refused.json()["required_scope"] == "operators"

        rotated = client.post("/v1/operators/alice/rotate", headers=admin, json={"grace_period_s": 3600})
        assert rotated.status_code == 201 and rotated.json()["replaces"] == first["token_id"]
        second = bearer(rotated.json()["token"])
        assert client.get("/v1/nodes", headers=alice).status_code == 200  # in its grace period
        assert client.get("/v1/nodes", headers=second).status_code == 200
        third = client.post("/v1/operators/alice/rotate", headers=admin, json={"grace_period_s": 0}).json()
        assert client.get("/v1/nodes", headers=second).status_code == 401  # no grace: ended now
        listed = client.get("/v1/operators", headers=admin).json()["items"]
        assert [(o["name"], o["role"], len(o["tokens"])) for o in listed] == [("alice", "fleet-operator", 3)]

        revoked = client.delete("/v1/operators/alice", headers=admin)
        assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
        assert client.get("/v1/nodes", headers=bearer(third["token"])).status_code == 401
        assert client.post("/v1/operators/alice/rotate", headers=admin).status_code == 409
        assert client.post("/v1/operators/nobody/rotate", headers=admin).status_code == 404


def test_an_operator_token_expires(tmp_path) -> None:
    with operator_api(tmp_path) as (client, settings):
        expired = role_token(settings, "old", Role.ADMIN, lifetime=timedelta(seconds=-1))
        assert client.get("/v1/nodes", headers=bearer(expired)).status_code == 401
        short = client.post(
            "/v1/operators",
            headers=bearer(settings.operator_token),
            json={"name": "x", "role": "admin", "expires_in_s": 1},
        )
        assert short.status_code == 422 and "expires_in_s" in short.text  # at least a minute


def test_node_events_name_the_operator_who_acted(tmp_path) -> None:
    with operator_api(tmp_path) as (client, settings):
        enroll(settings.database_url, ["n1"])
        alice = bearer(role_token(settings, "alice", Role.FLEET))
        assert client.post("/v1/nodes/n1/cordon", headers=alice, json={"reason": "fan"}).status_code == 200
        boot = bearer(settings.operator_token)
        assert client.post("/v1/nodes/n1/uncordon", headers=boot).status_code == 200
        with session_scope(settings.database_url) as session:
            events = session.exec(select(NodeTransition).where(col(NodeTransition.node_id) == "n1")).all()
            actors = {e.event: e.actor for e in events}
        assert actors["cordon"] == "operator:alice"
        assert actors["uncordon"] == "operator:bootstrap"
        listed = client.get("/v1/nodes/n1/events", headers=alice).json()["items"]
        assert {e["actor"] for e in listed if e["event"] in ("cordon", "uncordon")} == {
            "operator:alice",
            "operator:bootstrap",
        }


def test_a_token_written_for_an_account_revoked_meanwhile_opens_nothing(db_url) -> None:
    """A rotation that read the account before a revocation committed may still write a live
    token: the account's revocation ends it anyway (auth reads the account), and the revoked
    old token can no longer be rotated."""
    from gpucloud.api import auth
    from gpucloud.db import get_read_engine
    from gpucloud.services import operators

    with session_scope(db_url) as session:
        operators.create(session, "mallory", Role.ADMIN, created_by="test", lifetime=timedelta(days=1))
        operators.revoke(session, "mallory")
        _, late = operators._new_token(session, "mallory", lifetime=timedelta(days=1), now=operators.utcnow())
    with get_read_engine(db_url).connect() as connection:
        assert auth.resolve(connection, late, "bootstrap-token") is None
