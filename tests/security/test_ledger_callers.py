"""Issue 13, row 1: the ledger takes usage only from a node's own token for that node,
allocation events only from the control plane, the price book and reversals only from
operators, and nothing from anyone without a token the control plane signed.

Before: five made-up nodes x 1,024 GPUs billed to another tenant were accepted, and a reversal
without credentials got 201."""

from __future__ import annotations

import time

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gpucloud.ledger.app import create_app
from gpucloud.ledger.client import AgentLedgerToken
from gpucloud.web.service_tokens import LEDGER_AUDIENCE, Issuer, Verifier
from gpucloud.web.serving import ThreadedServer
from support.ledger_auth import LedgerAuth

pytestmark = [pytest.mark.integration, pytest.mark.one_database]


def _sample(node: str, seq: int, start: int) -> dict:
    return {
        "node_id": node,
        "seq": seq,
        "tenant_id": "t1",
        "allocation_id": "a1",
        "gpu_type": "H100",
        "gpu_count": 8,
        "start_ms": start,
        "end_ms": start + 60_000,
    }


def _bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def test_every_ledger_call_needs_the_right_role_and_an_agent_bills_only_its_own_node(tmp_path):
    auth = LedgerAuth(tmp_path)
    server = ThreadedServer(
        create_app(f"sqlite:///{tmp_path / 'ledger.db'}", control_plane=Verifier(auth.issuer.public_key)),
        name="ledger",
    )
    server.start()
    start = time.time_ns() // 1_000_000 - 3_600_000
    price_book = {"effective_from_ms": 0, "prices": [{"gpu_type": "H100", "price_per_hour_micro": 2_490_000}]}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            roles = {
                "nobody": {},
                "another key": _bearer(Issuer(Ed25519PrivateKey.generate()).mint(LEDGER_AUDIENCE, role="operator")),
                "agent gpu-1": _bearer(auth.token("agent", "node:gpu-1")),
                "control plane": _bearer(auth.token("control-plane")),
                "operator": _bearer(auth.token("operator")),
                "token for an agent, not the ledger": _bearer(
                    auth.issuer.mint("agent:gpu-1", subject="control-plane", role="control-plane")
                ),
            }
            answers = {}
            for who, headers in roles.items():
                answers[who] = {
                    "price book": http.post("/v1/price-book/versions", json=price_book, headers=headers).status_code,
                    "reversal": http.post("/v1/postings/1:reverse", json={"reason": "x"}, headers=headers).status_code,
                    "read usage": http.get("/v1/usage", params={"tenant_id": "t1"}, headers=headers).status_code,
                }
            for who in ("nobody", "another key", "token for an agent, not the ledger"):
                assert set(answers[who].values()) == {401}, (who, answers[who])
            assert answers["agent gpu-1"] == {"price book": 403, "reversal": 403, "read usage": 403}
            assert answers["control plane"]["price book"] == 403 and answers["control plane"]["reversal"] == 403
            assert answers["control plane"]["read usage"] == 200
            assert answers["operator"]["price book"] == 201 and answers["operator"]["reversal"] == 404  # no posting 1

            # Allocation events come from the control plane only.
            event = {"event_id": "e0", "allocation_id": "a1", "tenant_id": "t1", "kind": "start", "at_ms": start}
            assert http.post("/v1/allocation-events", json=event, headers=roles["agent gpu-1"]).status_code == 403
            assert http.post("/v1/allocation-events", json=event, headers=roles["operator"]).status_code == 403
            assert http.post("/v1/allocation-events", json=event, headers=roles["control plane"]).status_code == 201
            added = {**event, "event_id": "e1", "kind": "node_added", "node_id": "gpu-1", "gpu_type": "H100"}
            assert http.post("/v1/allocation-events", json=added, headers=roles["control plane"]).status_code == 201

            # An agent's token bills its own node only, never one it made up.
            forged = [_sample(f"made-up-{i}", 1, start) for i in range(5)]
            refused = http.post("/v1/usage:batch", json={"samples": forged}, headers=roles["agent gpu-1"])
            assert refused.status_code == 403 and "own node" in refused.json()["detail"]
            mixed = [_sample("gpu-1", 1, start), _sample("gpu-2", 1, start)]
            assert (
                http.post("/v1/usage:batch", json={"samples": mixed}, headers=roles["agent gpu-1"]).status_code == 403
            )
            own = http.post(
                "/v1/usage:batch", json={"samples": [_sample("gpu-1", 1, start)]}, headers=roles["agent gpu-1"]
            )
            assert own.status_code == 200 and own.json()["accepted"] == 1
            assert (
                http.post("/v1/usage:batch", json={"samples": mixed}, headers=roles["control plane"]).status_code == 403
            )
            # Nor time its node was not in the allocation: before it was added, or a node never added.
            early = _sample("gpu-1", 2, start - 2 * 3_600_000)
            answer = http.post("/v1/usage:batch", json={"samples": [early]}, headers=roles["agent gpu-1"]).json()
            assert answer["accepted"] == 0 and answer["rejections"][0]["problem"]["type"].endswith(
                "/node-not-in-allocation"
            )
            stranger = _sample("gpu-9", 1, start)
            answer = http.post("/v1/usage:batch", json={"samples": [stranger]}, headers=roles["operator"]).json()
            problem = answer["rejections"][0]["problem"]
            assert problem["type"].endswith("/node-not-yet-in-allocation") and problem["retryable"] is True
            usage = http.get("/v1/usage", params={"tenant_id": "t1"}, headers=roles["operator"]).json()
            assert usage["sample_count"] == 1
            assert http.get("/healthz").status_code == 200
    finally:
        server.stop()


async def test_the_api_hands_an_agent_a_ledger_token_for_its_own_node_only(db_url, make_harness):
    h = make_harness(db_url, nodes=1)
    (node_id,) = h.enroll_fleet()
    with h.operator as op:
        credential = op.post(f"/v1/nodes/{node_id}/agent-credential").json()["token"]
        operator_token = op.post("/v1/agents/ledger-token").json()["token"]
    with h.client(credential) as agent:
        answer = agent.post("/v1/agents/ledger-token")
    assert answer.status_code == 200 and answer.json()["expires_at"] > time.time() + 60
    claims = Verifier(LedgerAuth(h.settings.data_dir).issuer.public_key).verify(
        answer.json()["token"], audience=LEDGER_AUDIENCE, roles=("agent",)
    )
    assert (claims.subject, claims.role) == (f"node:{node_id}", "agent")
    assert (
        Verifier(LedgerAuth(h.settings.data_dir).issuer.public_key)
        .verify(operator_token, audience=LEDGER_AUDIENCE, roles=("operator",))
        .role
        == "operator"
    )
    with h.client("gpc_nobody.secret") as stranger:
        assert stranger.post("/v1/agents/ledger-token").status_code == 401
    # The agent's own provider asks for it with the node's credential and keeps it.
    provider = AgentLedgerToken(h.api.url, lambda: credential)
    token = provider()
    assert provider() == token
    verified = Verifier(LedgerAuth(h.settings.data_dir).issuer.public_key).verify(
        token, audience=LEDGER_AUDIENCE, roles=("agent",)
    )
    assert verified.subject == f"node:{node_id}"
    with pytest.raises(httpx.HTTPStatusError):
        AgentLedgerToken(h.api.url, lambda: "gpa_nobody.secret")()
