"""The typed client of gpucloud's public HTTP API, used by the CLI, the demo, the benchmarks and
the end-to-end tests (`base.ApiClient`: authentication, problem+json errors, retries, pagination
and bounded waits; one module per group of resources on top of it)."""
