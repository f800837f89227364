"""Calls to the billing ledger in tests, signed as the control plane signs them.

The ledger answers only tokens the control plane's issuer key signed for it; a test's ledger
trusts the issuer key kept in a directory of the test (the harness's data dir when a control
plane runs beside it, so both sign with the same key)."""

from __future__ import annotations

from pathlib import Path

import httpx

from gpucloud.web.service_tokens import LEDGER_AUDIENCE, Issuer, load_or_create_issuer


def issuer_in(directory: Path) -> Issuer:
    return load_or_create_issuer(directory / "issuer_key.pem")


class LedgerAuth(httpx.Auth):
    """Allocation events and reads as the control plane; the price book, reversals, closes and
    usage batches (for any node) as the operator."""

    def __init__(self, directory: Path) -> None:
        self.issuer = issuer_in(directory)

    def auth_flow(self, request: httpx.Request):
        path = request.url.path
        control_plane = request.method == "GET" or path in ("/v1/allocation-events", "/v1/reservations")
        role = "control-plane" if control_plane else "operator"
        request.headers["Authorization"] = f"Bearer {self.issuer.mint(LEDGER_AUDIENCE, subject=role, role=role)}"
        yield request

    def token(self, role: str, subject: str | None = None) -> str:
        return self.issuer.mint(LEDGER_AUDIENCE, subject=subject or role, role=role)


_DIRS: dict[str, Path] = {}


def register(url: str, directory: Path) -> None:
    """The ledger at `url` trusts the issuer key in `directory`."""
    _DIRS[url.rstrip("/")] = directory


def auth_for(url: str) -> LedgerAuth:
    """How to sign calls to the ledger at `url` (one registered by the harness that started it)."""
    return LedgerAuth(_DIRS[url.rstrip("/")])


def seed_allocation(url: str, auth: LedgerAuth, *, node: str, at_ms: int, allocation: str = "a1") -> None:
    """A ledger that prices H100 from a day before `at_ms` and knows allocation `allocation` of
    tenant t1 holding `node` from `at_ms` on, as the control plane would have told it."""
    prices = [{"gpu_type": "H100", "price_per_hour_micro": 2_490_000}]
    price_book = {"effective_from_ms": at_ms - 86_400_000, "prices": prices, "discounts": []}
    httpx.post(f"{url}/v1/price-book/versions", auth=auth, json=price_book).raise_for_status()
    for i, (kind, node_id) in enumerate((("start", None), ("node_added", node))):
        event = {"event_id": f"{allocation}-e{i}", "allocation_id": allocation, "tenant_id": "t1", "kind": kind}
        event |= {"at_ms": at_ms, "node_id": node_id, "gpu_type": "H100"}
        httpx.post(f"{url}/v1/allocation-events", auth=auth, json=event).raise_for_status()


MINUTE_MS = 60_000


def post_usage(ledger_url: str, *, tenant_id: str, allocation_id: str, node: str, start_ms: int, minutes: int) -> None:
    """`minutes` one-minute samples of one H100 node (8 GPUs) from `start_ms`, posted to the
    ledger as the control plane's usage; every one must be accepted."""
    samples = [
        {
            "node_id": node,
            "seq": seq + 1,
            "allocation_id": allocation_id,
            "tenant_id": tenant_id,
            "gpu_type": "H100",
            "gpu_count": 8,
            "start_ms": start_ms + seq * MINUTE_MS,
            "end_ms": start_ms + (seq + 1) * MINUTE_MS,
        }
        for seq in range(minutes)
    ]
    answer = httpx.post(auth=auth_for(ledger_url), url=f"{ledger_url}/v1/usage:batch", json={"samples": samples})
    assert answer.json()["accepted"] == minutes, answer.text
