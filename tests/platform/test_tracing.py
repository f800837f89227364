"""One trace from the API request through the allocation's workflow and its activities to the
agents' calls (OpenTelemetry: FastAPI, Temporal's interceptor and httpx instrumented), exported
to an in-memory exporter standing in for the OTLP one."""

from __future__ import annotations

import pytest

from support.stack import InProcessWorker

pytestmark = [pytest.mark.integration, pytest.mark.one_database]


@pytest.fixture
def spans():
    """Tracing on in this process, into memory (before the harness builds the API)."""
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gpucloud.config import Settings
    from gpucloud.observability import tracing

    exporter = InMemorySpanExporter()
    tracing._configured.clear()
    assert tracing.configure(Settings(), "test", exporter=exporter)
    yield exporter
    HTTPXClientInstrumentor().uninstrument()  # the rest of this process's tests run untraced
    tracing._configured.clear()


async def test_an_allocation_is_one_trace_from_the_api_to_the_agents(db_url, spans, make_harness) -> None:
    from gpucloud import bootstrap

    h = make_harness(db_url, nodes=2)
    client = await bootstrap.temporal_client(h.settings)  # with the tracing interceptor
    async with InProcessWorker(client, h.settings):
        h.enroll_fleet()
        await h.wait_states({"available": 2}, timeout_s=90)
        _, key = await h.onboard()
        with h.client(key) as tenant:
            created = tenant.post("/v1/allocations", json={"gpu_type": "H100", "node_count": 1, "region": "us-east-1"})
        assert created.status_code == 202, created.text
        await h.wait_allocation(key, created.json()["allocation"]["id"], "ready")
    finished = spans.get_finished_spans()
    start = next(s for s in finished if s.name == "StartWorkflow:AllocationWorkflow")
    trace_id = start.context.trace_id
    in_trace = [s for s in finished if s.context.trace_id == trace_id]
    names = {s.name for s in in_trace}
    assert "RunWorkflow:AllocationWorkflow" in names
    assert any(n.startswith("RunActivity:") for n in names)
    # The activity's call to the simulated agent (httpx), carrying the trace to it.
    agent_calls = [
        s for s in in_trace if s.kind.name == "CLIENT" and any("/actions/" in str(v) for v in s.attributes.values())
    ]
    assert agent_calls, sorted(names)
