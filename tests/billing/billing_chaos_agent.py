"""A stand-in host agent for the billing chaos test: meter + spool + shipper for a few nodes.

Run as its own process so the test can SIGKILL it at any point:

    python billing_chaos_agent.py SPOOL_DIR LEDGER_URL ALLOCATIONS_JSON INTERVAL_MS BATCH_SIZE ISSUER_DIR

Each node ships with a token for its own node, signed by the issuer key in ISSUER_DIR (what the
control plane would hand the node's agent).

ALLOCATIONS_JSON maps node id -> NodeAllocation fields; it is re-read at every tick, so the
test ends allocations by rewriting it.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

from gpucloud.agent.shipper import Shipper
from gpucloud.agent.spool import Meter, NodeAllocation, Spool
from gpucloud.ledger.client import UsageLedger
from gpucloud.web.service_tokens import LEDGER_AUDIENCE, load_or_create_issuer


def main(
    spool_dir: str, ledger_url: str, allocations_path: str, interval_ms: str, batch_size: str, issuer_dir: str
) -> None:
    issuer = load_or_create_issuer(Path(issuer_dir) / "issuer_key.pem")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def allocation_of(node_id: str) -> NodeAllocation | None:
        fields = json.loads(Path(allocations_path).read_text()).get(node_id)
        return None if fields is None else NodeAllocation(**fields)

    threads = []
    for node_id in json.loads(Path(allocations_path).read_text()):
        spool = Spool(Path(spool_dir) / f"{node_id}.db", node_id)
        meter = Meter(spool, lambda node_id=node_id: allocation_of(node_id), interval_ms=int(interval_ms))
        shipper = Shipper(
            spool,
            UsageLedger(
                ledger_url,
                timeout_s=5,
                token=lambda node_id=node_id: issuer.mint(LEDGER_AUDIENCE, subject=f"node:{node_id}", role="agent"),
            ),
            batch_size=int(batch_size),
            backoff_initial_s=0.05,
            backoff_max_s=0.4,
            idle_poll_s=0.02,
            retry_rejected_after_ms=200,
        )
        threads += [
            threading.Thread(target=meter.run, args=(stop,)),
            threading.Thread(target=shipper.run, args=(stop,)),
        ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    main(*sys.argv[1:])
