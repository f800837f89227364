"""Issue 13, row 6: a re-imaged node's new usage spool does not restart `seq` at 1.

Before: every sample of the new spool collided with one the ledger already held for the node
(same node_id and seq, other content) and was rejected for good: that node's usage was lost.
Now a spool's seqs start at its epoch (the second it was created, shifted), above any seq an
older spool of the node assigned."""

from __future__ import annotations

import time

import httpx
import pytest

from gpucloud.agent.shipper import Shipper
from gpucloud.agent.spool import Spool, Usage
from gpucloud.ledger.app import create_app
from gpucloud.ledger.client import UsageLedger
from gpucloud.web.service_tokens import Verifier
from gpucloud.web.serving import ThreadedServer
from support.ledger_auth import LedgerAuth, seed_allocation

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

HOUR_MS = 3_600_000


def test_a_reimaged_nodes_new_spool_is_billed_beside_its_old_one(tmp_path):
    now_ms = time.time_ns() // 1_000_000
    start = now_ms - 2 * HOUR_MS
    auth = LedgerAuth(tmp_path)
    app = create_app(f"sqlite:///{tmp_path / 'ledger.db'}", control_plane=Verifier(auth.issuer.public_key))
    server = ThreadedServer(app, name="ledger")
    server.start()
    try:
        url = server.url
        node_token = auth.token("agent", "node:gpu-1")
        seed_allocation(url, auth, node="gpu-1", at_ms=start)

        def usage(i: int) -> Usage:
            return Usage("a1", "t1", "H100", 8, start + i * 60_000, start + (i + 1) * 60_000)

        # The node's first life: its spool, created two hours ago, ships three samples.
        old = Spool(tmp_path / "old-spool.db", "gpu-1", clock_ms=lambda: start)
        for i in range(3):
            old.append(usage(i))
        assert Shipper(old, UsageLedger(url, token=lambda: node_token)).ship_once().acked == 3
        # Re-imaged: a fresh spool (its disk was wiped) meters the next minutes of the same node.
        new = Spool(tmp_path / "new-spool.db", "gpu-1", clock_ms=lambda: now_ms)
        for i in range(3, 5):
            new.append(usage(i))
        assert new.epoch_base > old.last_seq()
        shipped = Shipper(new, UsageLedger(url, token=lambda: node_token)).ship_once()
        assert (shipped.acked, shipped.rejected) == (2, 0)
        billed = httpx.get(f"{url}/v1/usage", params={"tenant_id": "t1", "allocation_id": "a1"}, auth=auth).json()
        assert billed["sample_count"] == 5 and billed["gpu_ms"] == 5 * 60_000 * 8
        assert httpx.get(f"{url}/v1/usage/conflicts", auth=auth).json() == []
        old.close()
        new.close()
    finally:
        server.stop()
