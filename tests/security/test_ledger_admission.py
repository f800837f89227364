"""The ledger shares its slots per node, as the API does: tenants have root on the nodes they
rent, and one node's agent (or whatever replaced it) flooding the ledger is answered 429 at once
while the other nodes' usage and the control plane's calls still land.

The app under test is the ledger's own middleware in its order (the gate checking the control
plane's tokens, then admission) in front of a route that holds its slot until released."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gpucloud.config import LedgerSettings
from gpucloud.ledger.api.admission import LedgerAdmission
from gpucloud.ledger.api.callers import ledger_callers
from gpucloud.web.gate import BODY_DEFAULTS, Gate
from gpucloud.web.service_tokens import LEDGER_AUDIENCE, Issuer, Verifier
from support.held import Held

pytestmark = pytest.mark.integration

CONTROL_PLANE = Issuer(Ed25519PrivateKey.generate())


def _token(subject: str, role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {CONTROL_PLANE.mint(LEDGER_AUDIENCE, subject=subject, role=role)}"}


async def test_one_node_holds_at_most_its_share_and_the_others_still_land() -> None:
    held = Held()
    settings = LedgerSettings(agent_slots=8, node_share=0.25, control_plane_slots=2, admission_wait_s=0.2)
    app = Gate(
        LedgerAdmission(held, settings=settings),
        check=ledger_callers(Verifier(CONTROL_PLANE.public_key)),
        body=BODY_DEFAULTS,
    )
    flooder, other = _token("node:n1", "agent"), _token("node:n2", "agent")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ledger") as client:

        def post(headers: dict[str, str], path: str = "/v1/usage:batch"):
            return asyncio.ensure_future(client.post(path, json={"samples": []}, headers=headers))

        mine = [post(flooder) for _ in range(2)]  # its share: 8 x 0.25
        await held.until(2)
        refused = await client.post("/v1/usage:batch", json={"samples": []}, headers=flooder)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
        assert "this node already has 2 requests in flight" in refused.json()["detail"]
        theirs = post(other)
        closing = post(_token("control-plane", "control-plane"), "/v1/allocation-events")
        await held.until(4)
        held.go.set()
        answers = await asyncio.gather(*mine, theirs, closing)
    assert [a.status_code for a in answers] == [200, 200, 200, 200]


async def test_a_token_the_gate_refuses_takes_no_slot() -> None:
    held = Held()
    held.go.set()
    app = Gate(
        LedgerAdmission(held, settings=LedgerSettings(agent_slots=1, node_share=1.0)),
        check=ledger_callers(Verifier(CONTROL_PLANE.public_key)),
        body=BODY_DEFAULTS,
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ledger") as client:
        stranger = Issuer(Ed25519PrivateKey.generate()).mint(LEDGER_AUDIENCE, subject="node:n1", role="agent")
        answer = await client.post("/v1/usage:batch", json={}, headers={"Authorization": f"Bearer {stranger}"})
    assert answer.status_code == 401 and held.in_flight == 0
