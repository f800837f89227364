"""Timeouts and retry policies for every activity the workflows call, in one place."""

from datetime import timedelta

from temporalio.common import RetryPolicy

# One short DB transaction: retry transient errors (locked DB, lost connection) for a while.
DB = dict(
    start_to_close_timeout=timedelta(seconds=30),
    schedule_to_close_timeout=timedelta(minutes=10),
    retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=200), backoff_coefficient=2.0,
                             maximum_interval=timedelta(seconds=10)),
)

# A host-agent action: minutes on real hardware, heartbeats while it waits; a few retries with
# growing delays, then the node goes to its state's failure target.
AGENT = dict(
    start_to_close_timeout=timedelta(minutes=20),
    heartbeat_timeout=timedelta(seconds=30),
    retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=2.0,
                             maximum_interval=timedelta(seconds=30), maximum_attempts=6,
                             non_retryable_error_types=["AgentActionFailed"]),
)
