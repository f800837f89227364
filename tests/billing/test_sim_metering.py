"""The simulated fleet's metering: each node's meter, spool and shipper feed a real ledger exactly,
also across a ledger outage and a restart of the sim."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from gpucloud.agent.spool import NodeAllocation, wall_clock_ms
from gpucloud.devstack.stack import free_port
from gpucloud.sim.metering import FleetMetering
from support.ledger_auth import auth_for
from support.ledger_harness import ledger_in_thread
from support.stack import wait_until

pytestmark = pytest.mark.integration

INTERVAL_MS = 50


@contextmanager
def running(metering: FleetMetering) -> Iterator[FleetMetering]:
    stop = threading.Event()
    thread = threading.Thread(target=metering.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield metering
    finally:
        stop.set()
        thread.join(10)
        metering.close()


def metered_gpu_ms(report: dict, allocation_id: str) -> int:
    return sum(
        (a["ended_ms"] - a["started_ms"]) * a["gpu_count"]
        for node in report["nodes"].values()
        for a in node["allocations"]
        if a["allocation_id"] == allocation_id
    )


def test_usage_reaches_the_ledger_exactly_across_an_outage_and_a_restart(tmp_path: Path) -> None:
    spools = tmp_path / "spools"
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens here: the ledger is down
    with running(FleetMetering(spools, down, interval_ms=INTERVAL_MS)) as metering:
        now = wall_clock_ms()
        metering.start("n1", NodeAllocation("a1", "t1", "H100", 8, started_ms=now))
        metering.start("n2", NodeAllocation("a1", "t1", "H100", 8, started_ms=now))
        metering.start("n1", NodeAllocation("a1", "t1", "H100", 8, started_ms=now + 5))  # a repeat: no-op
        time.sleep(0.5)
        metering.stop("n2", wall_clock_ms())
        time.sleep(0.3)
        metering.stop("n1", wall_clock_ms())
        truth = metered_gpu_ms(metering.report(), "a1")
        backlog = metering.report()
        assert backlog["pending"] >= 10 and all(len(n["allocations"]) == 1 for n in backlog["nodes"].values())

    with ledger_in_thread(f"sqlite:///{tmp_path / 'ledger.db'}", issuer_dir=tmp_path) as url:
        price_book = {"effective_from_ms": 0, "prices": [{"gpu_type": "H100", "price_per_hour_micro": 2_490_000}]}
        assert httpx.post(auth=auth_for(url), url=f"{url}/v1/price-book/versions", json=price_book).status_code == 201
        # A restarted sim finds the spools and ships what the outage held back.
        operator = auth_for(url).token("operator")
        metering = FleetMetering(
            spools, url, interval_ms=INTERVAL_MS, node_ids=["n1", "n2", "n3"], token=lambda: operator
        )
        with running(metering):
            wait_until(lambda: metering.report()["pending"] == 0, timeout_s=30, what="the backlog shipped")
            assert sorted(metering.report()["nodes"]) == ["n1", "n2"]
        usage = httpx.get(
            auth=auth_for(url), url=f"{url}/v1/usage", params={"tenant_id": "t1", "allocation_id": "a1"}
        ).json()
        assert usage["gpu_ms"] == truth
        assert usage["sample_count"] == backlog["nodes"]["n1"]["samples"] + backlog["nodes"]["n2"]["samples"]
