"""Prometheus metrics (`prometheus-client`): the families every process records, and `/metrics`.

Each process records what it sees, in the process's default registry:

| family | where it is recorded |
|---|---|
| `gpucloud_nodes{state,gpu_type,region}`, `gpucloud_allocations{status}` | read from the DB at scrape (API) |
| `gpucloud_api_requests_total{method,route,status}`, `gpucloud_api_request_seconds` | API, per route |
| `gpucloud_allocation_ready_seconds` | worker: an allocation's request to `ready` |
| `gpucloud_health_fault_to_cordon_seconds` | API: a fault's timestamp to the node's cordon |
| `gpucloud_health_fault_to_pulled_seconds` | worker: the fault to the node out of its allocation |
| `gpucloud_reconciler_sweep_seconds`, `gpucloud_reconciler_sweep_nodes{kind}` | worker, each sweep |
| `gpucloud_spares{pool,kind}` | worker: spare nodes a pool needs (`needed`) and holds (`held`), each spares check |
| `gpucloud_mtbf_hours{gpu_type,region,rack}` | worker: node-hours per node failure, each spares check |
| `gpucloud_mttr_seconds{gpu_type,region,rack}` | worker: mean fault to gated (back in the pool), each spares check |
| `gpucloud_mtts_seconds{gpu_type,region,rack}` | worker: mean fault to stabilized (`rack=""`: the pool), each check |
| `gpucloud_ledger_usage_samples_total{outcome}` | ledger, each ingested batch |
| `gpucloud_ledger_usage_rejected_total{reason}` | ledger, each rejected sample (`ledger/rejections.py`) |
| `gpucloud_agent_spool_pending_samples`, `gpucloud_agent_spool_lag_seconds` | agent's shipper |
| `gpucloud_rollout_node_steps_total{step,outcome}`, `gpucloud_rollout_waves_total{outcome}` | worker |
| `gpucloud_chunk_bytes_served_total{source}` | origin (`origin`) and peers (`peer`) |
| `temporal_*` | worker: the Temporal SDK's own runtime metrics (`TemporalMetrics`) |

`/metrics` answers only the metrics token or the operator token (`authorized`). Several API
processes on one port (`gpucloud api --workers N`) share a multiprocess directory, so a scrape
of any of them sums all of them (`PROMETHEUS_MULTIPROC_DIR`, set by `serve`).
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gpucloud.web import problems

log = logging.getLogger(__name__)

# Seconds, from a fast API call to an allocation that waits out a slow provision.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

API_REQUESTS = Counter("gpucloud_api_requests", "API requests answered", ["method", "route", "status"])
API_LATENCY = Histogram(
    "gpucloud_api_request_seconds", "API request latency", ["method", "route"], buckets=LATENCY_BUCKETS
)
ALLOCATION_READY = Histogram(
    "gpucloud_allocation_ready_seconds", "An allocation's request to ready", buckets=LATENCY_BUCKETS
)
FAULT_TO_CORDON = Histogram(
    "gpucloud_health_fault_to_cordon_seconds", "A fault's timestamp to its node's cordon", buckets=LATENCY_BUCKETS
)
FAULT_TO_PULLED = Histogram(
    "gpucloud_health_fault_to_pulled_seconds",
    "A fault's timestamp to its node out of the allocation",
    buckets=LATENCY_BUCKETS,
)
SWEEP_SECONDS = Histogram("gpucloud_reconciler_sweep_seconds", "One reconciler sweep", buckets=LATENCY_BUCKETS)
SWEEP_NODES = Gauge(
    "gpucloud_reconciler_sweep_nodes",
    "Nodes the last sweep found (candidates) and started operations on (started)",
    ["kind"],
    multiprocess_mode="livemax",
)
SPARES = Gauge(
    "gpucloud_spares",
    "Spare nodes a pool (GPU type/region) needs (kind=needed) and holds (kind=held), at the last spares check",
    ["pool", "kind"],
    multiprocess_mode="livemax",
)
# Per GPU type, region and rack, over the spares window (`health/reliability.py`); rack="" is
# the GPU type and region's rollup. A place without failures (repairs) has no MTBF (MTTR) series.
_PLACE = ["gpu_type", "region", "rack"]
MTBF_HOURS = Gauge(
    "gpucloud_mtbf_hours",
    "Node-hours in the fleet per node failure (node incident) over the spares window, at the last spares check",
    _PLACE,
    multiprocess_mode="livemax",
)
MTTR_SECONDS = Gauge(
    "gpucloud_mttr_seconds",
    "Mean fault-to-gated (back in the pool) time of the node incidents gated in the spares window",
    _PLACE,
    multiprocess_mode="livemax",
)
MTTS_SECONDS = Gauge(
    "gpucloud_mtts_seconds",
    "Mean fault-to-stabilized time of the node incidents stabilized in the spares window",
    _PLACE,
    multiprocess_mode="livemax",
)
LEDGER_SAMPLES = Counter("gpucloud_ledger_usage_samples", "Usage samples the ledger took", ["outcome"])
LEDGER_REJECTED = Counter(
    "gpucloud_ledger_usage_rejected", "Usage samples the ledger rejected, by reason (a fixed set)", ["reason"]
)
SPOOL_PENDING = Gauge(
    "gpucloud_agent_spool_pending_samples", "Samples in the agent's spool not yet shipped", multiprocess_mode="livemax"
)
SPOOL_LAG = Gauge(
    "gpucloud_agent_spool_lag_seconds", "Age of the oldest sample not yet shipped", multiprocess_mode="livemax"
)
ROLLOUT_NODE_STEPS = Counter(
    "gpucloud_rollout_node_steps", "Rollout steps on nodes (prefetch, verify, activate, check)", ["step", "outcome"]
)
PREEMPTIONS = Counter(
    "gpucloud_preemptions", "Preemptible allocations taken back for another request", ["gpu_type", "region"]
)
SCHEDULER_PLACEMENTS = Counter(
    "gpucloud_queue_placements", "Queued allocations placed by their pool's scheduler", ["gpu_type", "region"]
)
ROLLOUT_WAVES = Counter("gpucloud_rollout_waves", "Rollout waves checked", ["outcome"])
CHUNK_BYTES = Counter("gpucloud_chunk_bytes_served", "Weight chunk bytes served", ["source"])


def registry_for_scrape() -> CollectorRegistry:
    """The registry a scrape reads: this process's, or every API process's when they share a
    multiprocess directory."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry
    return REGISTRY


def authorized(request: Request, tokens: Iterable[str]) -> bool:
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and any(hmac.compare_digest(given.encode(), t.encode()) for t in tokens if t)


def install_metrics(
    app: FastAPI,
    tokens: Callable[[], Iterable[str]],
    *,
    collectors: Iterable[Collector] = (),
    before_scrape: Callable[[], None] | None = None,
) -> None:
    """Add `GET /metrics` for callers holding one of `tokens()`; `collectors` are read at each
    scrape on top of the process's registry (what is better read from the DB when asked), after
    `before_scrape` (say, draining a buffer into the registry)."""
    extra = list(collectors)

    @app.get("/metrics", include_in_schema=False)
    def metrics(request: Request) -> Response:
        if not authorized(request, tokens()):
            return problems.unauthenticated("send the metrics token (or the operator token) as a bearer token")
        if before_scrape is not None:
            before_scrape()
        registry = registry_for_scrape()
        body = generate_latest(registry)
        if extra:
            scratch = CollectorRegistry()
            for collector in extra:
                scratch.register(collector)
            body += generate_latest(scratch)
        return Response(body, media_type=CONTENT_TYPE_LATEST)


class RequestMetrics:
    """ASGI middleware: every answer counted and timed by its route's template (not its path, so
    ids do not explode the label set)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] == "/metrics":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), [500]

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            API_REQUESTS.labels(scope["method"], route, str(status[0])).inc()
            API_LATENCY.labels(scope["method"], route).observe(time.perf_counter() - started)


class FleetCollector(Collector):
    """Nodes by state, GPU type and region and allocations by status, read from the DB when
    scraped (the truth, whichever process changed it)."""

    def __init__(self, db_url: str) -> None:
        self.db_url = db_url

    def collect(self) -> Iterable[GaugeMetricFamily]:
        import sqlalchemy as sa
        from sqlmodel import col, select

        from gpucloud.db import read_scope
        from gpucloud.models.tables import Allocation, Node

        nodes = GaugeMetricFamily(
            "gpucloud_nodes", "Nodes by state, GPU type and region", labels=["state", "gpu_type", "region"]
        )
        allocations = GaugeMetricFamily("gpucloud_allocations", "Allocations by status", labels=["status"])
        with read_scope(self.db_url) as session:  # a scrape takes no write lock
            for state, gpu_type, region, count in session.exec(
                select(col(Node.state), col(Node.gpu_type), col(Node.region), sa.func.count()).group_by(
                    col(Node.state), col(Node.gpu_type), col(Node.region)
                )
            ):
                nodes.add_metric([str(state), str(gpu_type), str(region)], float(count))
            for status, count in session.exec(
                select(col(Allocation.status), sa.func.count()).group_by(col(Allocation.status))
            ):
                allocations.add_metric([str(status)], float(count))
        yield nodes
        yield allocations


class TemporalMetrics:
    """The Temporal SDK's runtime metrics (task slots, schedule-to-start latency, polls, ...) as
    Prometheus families of this process: the SDK records into a `MetricBuffer`, drained into
    `temporal_<name>` counters, gauges and histograms every `interval_s` (no server of its own,
    so nothing unauthenticated listens)."""

    def __init__(self, interval_s: float = 5.0) -> None:
        from temporalio.runtime import MetricBuffer, MetricBufferDurationFormat, Runtime, TelemetryConfig

        self.buffer = MetricBuffer(100_000, duration_format=MetricBufferDurationFormat.SECONDS)
        from gpucloud.adapters.temporal import core_logging

        self.runtime = Runtime(telemetry=TelemetryConfig(metrics=self.buffer, logging=core_logging()))
        self._families: dict[int, tuple[Any, list[str]]] = {}
        self._by_name: dict[str, tuple[Any, list[str]]] = {}
        self._skipped: set[str] = set()
        self._draining = threading.Lock()
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain_forever, name="temporal-metrics", daemon=True)

    def start(self) -> TemporalMetrics:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.drain()

    def _drain_forever(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.drain()

    def drain(self) -> None:
        with self._draining:
            self._drain()

    def _drain(self) -> None:
        for update in self.buffer.retrieve_updates():
            try:
                self._apply(update)
            except ValueError as exc:  # a metric this bridge cannot map: skipped, said once
                if update.metric.name not in self._skipped:
                    self._skipped.add(update.metric.name)
                    log.warning("Temporal SDK metric %s not exported: %s", update.metric.name, exc)

    def _apply(self, update: Any) -> None:
        from temporalio.runtime import BUFFERED_METRIC_KIND_COUNTER as COUNTER
        from temporalio.runtime import BUFFERED_METRIC_KIND_GAUGE as GAUGE

        metric = update.metric
        known = self._families.get(id(metric))
        if known is None:
            name = "temporal_" + metric.name.replace(".", "_").removeprefix("temporal_")
            known = self._by_name.get(name)
            if known is None:
                labels = sorted(update.attributes)
                description = metric.description or metric.name
                if metric.kind == COUNTER:
                    family: Any = Counter(name, description, labels)
                elif metric.kind == GAUGE:
                    family = Gauge(name, description, labels, multiprocess_mode="livemax")
                else:
                    family = Histogram(name, description, labels, buckets=LATENCY_BUCKETS)
                known = self._by_name[name] = (family, labels)
            self._families[id(metric)] = known
        family, labels = known
        child = family.labels(*(str(update.attributes.get(k, "")) for k in labels)) if labels else family
        if metric.kind == COUNTER:
            child.inc(update.value)
        elif metric.kind == GAUGE:
            child.set(update.value)
        else:
            child.observe(update.value)
