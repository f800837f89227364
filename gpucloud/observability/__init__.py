"""What every gpucloud process reports about itself: structured logs with request context
(`logs`) and OpenTelemetry traces across HTTP and Temporal (`tracing`). Metrics live with the
HTTP servers (`gpucloud.web.metrics`)."""
