"""OpenTelemetry traces, off unless an OTLP endpoint is configured
(`GPUCLOUD_TELEMETRY__OTLP_ENDPOINT`, OTLP over HTTP: `http://collector:4318/v1/traces`).

One trace follows a request through every process: the API's FastAPI instrumentation opens the
server span; Temporal's own interceptor (`temporalio.contrib.opentelemetry.TracingInterceptor`,
on the client `bootstrap.temporal_client` builds, so on the API's and the worker's) carries the
context into the workflow it starts and from there into each activity; the httpx
instrumentation carries it from the activity to the agent, the ledger or the fabric managers
(`traceparent`), whose own FastAPI instrumentation continues it. Spans are batched and exported
in the background; an unreachable collector costs dropped spans, never a request.
"""

from __future__ import annotations

import logging
from typing import Any

from gpucloud.config import Settings

log = logging.getLogger(__name__)

_configured: dict[str, Any] = {}


def enabled() -> bool:
    """Whether this process traces (`configure` turned it on)."""
    return bool(_configured)


def configure(settings: Settings, service: str, *, exporter: Any = None) -> bool:
    """Set up tracing for this process once (the first call names the service); `exporter`
    replaces the OTLP one (tests). Whether tracing is on."""
    if _configured:
        return True
    if exporter is None and settings.telemetry.otlp_endpoint is None:
        return False
    from opentelemetry import trace
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"gpucloud-{service}"}))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.telemetry.otlp_endpoint)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        _configured["exporter"] = exporter
    trace.set_tracer_provider(provider)
    HTTPXClientInstrumentor().instrument()
    _configured["provider"] = provider
    log.info("tracing on: spans of gpucloud-%s to %s", service, settings.telemetry.otlp_endpoint or "a test exporter")
    return True


def temporal_interceptors() -> list[Any]:
    """The Temporal client's interceptors: the tracing one when tracing is on."""
    if not enabled():
        return []
    from temporalio.contrib.opentelemetry import TracingInterceptor

    return [TracingInterceptor()]


def instrument_app(app: Any) -> None:
    """Server spans for a FastAPI app (continuing the caller's trace), when tracing is on."""
    if enabled():
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        FastAPIInstrumentor.instrument_app(app, excluded_urls="healthz,readyz,metrics")
