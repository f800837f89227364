"""Billing close on Temporal: the scheduled catch-up closes every ended period once, oldest first,
through the ledger's HTTP API (a real ledger, the real Temporal dev server, the production worker).

The ledger runs on a clock the test moves, so periods end when the test says so.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from temporalio.client import ScheduleIntervalSpec, WorkflowExecutionStatus
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError

from gpucloud.adapters.temporal_gateway import billing_schedule_id, ensure_billing_close_schedule
from gpucloud.config import Settings
from gpucloud.ledger.periods import period_bounds
from gpucloud.ledger.pricing import Rate
from gpucloud.models.billing_messages import BillingCatchUpInput, BillingCloseInput
from gpucloud.models.workflow_ids import close_workflow_id
from gpucloud.workflows.billing_close import BillingCatchUpWorkflow, BillingCloseWorkflow
from support.codec import CODEC_KEYS
from support.ledger_auth import LedgerAuth
from support.ledger_harness import ledger_in_thread
from support.stack import async_wait_until

pytestmark = pytest.mark.integration

MINUTE = 60_000
PRICE = 2_490_000
JAN, FEB, MAR, APR = (period_bounds(p)[0] for p in ("2024-01", "2024-02", "2024-03", "2024-04"))


class Clock:
    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[tuple[httpx.Client, Clock]]:
    clock = Clock(MAR + 10 * 86_400_000)  # mid-March 2024: January and February have ended
    with (
        ledger_in_thread(f"sqlite:///{tmp_path / 'ledger.db'}", issuer_dir=tmp_path, clock_ms=clock) as url,
        httpx.Client(base_url=url, timeout=30, auth=LedgerAuth(tmp_path)) as client,
    ):
        price_book = {"effective_from_ms": 0, "prices": [{"gpu_type": "h100", "price_per_hour_micro": PRICE}]}
        assert client.post("/v1/price-book/versions", json=price_book).status_code == 201
        yield client, clock


def settings_for(
    tmp_path: Path, db_url: str, temporal_env, ledger_url: str | None, *, close_interval_s: float = 86_400.0
) -> Settings:
    return Settings(
        data_dir=tmp_path,
        database={"url": db_url},
        api={"operator_token": "test-operator-token"},
        temporal={
            "address": temporal_env.client.service_client.config.target_host,
            "task_queue": f"tq-{uuid.uuid4().hex[:10]}",
            "codec_keys": CODEC_KEYS,
        },
        ledger={"url": ledger_url, "close_interval_s": close_interval_s},
    )


def ingest(client: httpx.Client, *, start: int, count: int, node: str = "n1") -> None:
    samples = [
        {
            "node_id": node,
            "seq": start + seq,
            "allocation_id": "a1",
            "tenant_id": "t1",
            "gpu_type": "h100",
            "gpu_count": 8,
            "start_ms": start + seq * MINUTE,
            "end_ms": start + (seq + 1) * MINUTE,
        }
        for seq in range(count)
    ]
    assert client.post("/v1/usage:batch", json={"samples": samples}).json()["accepted"] == count


async def catch_up(temporal_env, settings: Settings):
    return await temporal_env.client.execute_workflow(
        BillingCatchUpWorkflow.run,
        BillingCatchUpInput(),
        id=f"test-catch-up-{uuid.uuid4().hex[:8]}",
        task_queue=settings.temporal.task_queue,
    )


async def test_catch_up_closes_every_ended_period_once_oldest_first(
    tmp_path, db_url, temporal_env, in_process_worker, ledger
) -> None:
    client, clock = ledger
    settings = settings_for(tmp_path, db_url, temporal_env, str(client.base_url))
    await in_process_worker(settings)
    for start, count in ((JAN, 10), (FEB, 20), (MAR, 5)):
        ingest(client, start=start, count=count)

    first = await catch_up(temporal_env, settings)
    assert (first.closed, first.failed) == (["2024-01", "2024-02"], None)  # March has not ended
    january = client.get("/v1/periods/2024-01/invoices/t1")
    assert january.json()["total_micro"] == Rate(PRICE).amount_for(10 * 8 * MINUTE)
    assert client.get("/v1/periods/2024-02/invoices/t1").json()["total_micro"] == Rate(PRICE).amount_for(
        20 * 8 * MINUTE
    )
    for period in ("2024-01", "2024-02"):
        handle = temporal_env.client.get_workflow_handle(close_workflow_id(settings.temporal.task_queue, period))
        assert (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED

    assert (await catch_up(temporal_env, settings)).closed == []  # nothing new has ended
    # A period closes once: its close workflow cannot run again under its id.
    with pytest.raises(WorkflowAlreadyStartedError):
        await temporal_env.client.start_workflow(
            BillingCloseWorkflow.run,
            BillingCloseInput(period_id="2024-01"),
            id=close_workflow_id(settings.temporal.task_queue, "2024-01"),
            task_queue=settings.temporal.task_queue,
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
        )

    # Late January usage lands on March's invoice; March closes once it has ended.
    ingest(client, start=JAN + 100 * MINUTE, count=2, node="n-late")
    clock.now_ms = APR + 1
    assert (await catch_up(temporal_env, settings)).closed == ["2024-03"]
    march = client.get("/v1/periods/2024-03/invoices/t1").json()
    used_in = {line["usage_period"]: line["quantity"] for line in march["lines"]}
    assert used_in == {"2024-03": 5 * 8 * MINUTE, "2024-01": 2 * 8 * MINUTE}
    assert client.get("/v1/periods/2024-01/invoices/t1").content == january.content  # immutable


async def test_the_schedule_is_created_idempotently_and_runs_the_catch_up(
    tmp_path, db_url, temporal_env, in_process_worker, ledger
) -> None:
    client, _clock = ledger
    settings = settings_for(tmp_path, db_url, temporal_env, str(client.base_url), close_interval_s=1.0)
    assert await ensure_billing_close_schedule(temporal_env.client, settings)
    assert await ensure_billing_close_schedule(temporal_env.client, settings)  # again: updated, not duplicated
    handle = temporal_env.client.get_schedule_handle(billing_schedule_id(settings))
    try:
        spec = (await handle.describe()).schedule.spec
        assert spec.intervals == [ScheduleIntervalSpec(every=timedelta(seconds=1), offset=timedelta(seconds=0.5))]
        ingest(client, start=FEB, count=3)
        await in_process_worker(settings)
        await async_wait_until(
            lambda: client.get("/v1/periods").json()[0]["closed_ms"] is not None,
            timeout_s=60,
            what="the scheduled catch-up closed February",
        )
    finally:
        await handle.delete()
    no_ledger = settings_for(tmp_path, db_url, temporal_env, None)
    assert not await ensure_billing_close_schedule(temporal_env.client, no_ledger)
