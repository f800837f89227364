"""Timeouts and retry policies for every activity the workflows call, in one place."""

from datetime import timedelta

from temporalio.common import RetryPolicy

# One short DB transaction: retry transient errors (locked DB, lost connection) for a while.
DB = dict(
    start_to_close_timeout=timedelta(seconds=30),
    schedule_to_close_timeout=timedelta(minutes=10),
    retry_policy=RetryPolicy(
        initial_interval=timedelta(milliseconds=200), backoff_coefficient=2.0, maximum_interval=timedelta(seconds=10)
    ),
)

# A host-agent action: minutes on real hardware, heartbeats while it waits; a few retries with
# growing delays, then the node goes to its state's failure target.
AGENT = dict(
    start_to_close_timeout=timedelta(minutes=20),
    heartbeat_timeout=timedelta(seconds=30),
    retry_policy=RetryPolicy(
        initial_interval=timedelta(seconds=1),
        backoff_coefficient=2.0,
        maximum_interval=timedelta(seconds=30),
        maximum_attempts=6,
        non_retryable_error_types=["AgentActionFailed"],
    ),
)

# One action on a batch of agents (bring-up): the activity retries each unreachable agent itself
# and reports the ones that stay silent, so Temporal retries only a lost worker or a crash.
AGENT_BATCH = dict(
    start_to_close_timeout=timedelta(minutes=30),
    heartbeat_timeout=timedelta(seconds=60),
    retry_policy=RetryPolicy(
        initial_interval=timedelta(seconds=1),
        backoff_coefficient=2.0,
        maximum_interval=timedelta(seconds=30),
        maximum_attempts=5,
    ),
)

# A call to the billing ledger, a separate service that may be down for hours: retried with
# growing delays for as long as it takes (allocation events must get there, and usage for an
# allocation the ledger has not heard of waits in the agents' spools); a refusal is final.
LEDGER = dict(
    start_to_close_timeout=timedelta(seconds=60),
    retry_policy=RetryPolicy(
        initial_interval=timedelta(seconds=1),
        backoff_coefficient=2.0,
        maximum_interval=timedelta(seconds=60),
        non_retryable_error_types=["LedgerRefused", "LedgerNotConfigured"],
    ),
)

# Closing a period aggregates all of its usage (10 million events: about two minutes).
LEDGER_CLOSE = {**LEDGER, "start_to_close_timeout": timedelta(minutes=15)}

# Applying an allocation's fabric membership (a few calls to each fabric manager, then a
# read-back): a manager that is down or answers a read that differs is retried, but not past the
# nodes' reservation deadline (10 minutes): the allocation then fails closed. A refusal is final.
FABRIC_APPLY = dict(
    start_to_close_timeout=timedelta(seconds=60),
    schedule_to_close_timeout=timedelta(minutes=4),
    retry_policy=RetryPolicy(
        initial_interval=timedelta(milliseconds=500),
        backoff_coefficient=2.0,
        maximum_interval=timedelta(seconds=15),
        non_retryable_error_types=["FabricRefused", "AllocationNotFound", "NodeNotFound"],
    ),
)

# Taking membership away is retried for as long as it takes: a node that keeps it must not go
# back to the pool (the workflow waits here before the node's release or drain goes on).
FABRIC_REMOVE = dict(
    start_to_close_timeout=timedelta(seconds=60),
    retry_policy=RetryPolicy(
        initial_interval=timedelta(milliseconds=500),
        backoff_coefficient=2.0,
        maximum_interval=timedelta(seconds=30),
        non_retryable_error_types=["AllocationNotFound", "NodeNotFound"],
    ),
)

# A step of tenant onboarding (the SDN controller, the object store): transient errors are
# retried a few times, then the onboarding is undone rather than left half-made.
TENANT_STEP = dict(
    start_to_close_timeout=timedelta(seconds=60),
    retry_policy=RetryPolicy(
        initial_interval=timedelta(milliseconds=500),
        backoff_coefficient=2.0,
        maximum_interval=timedelta(seconds=10),
        maximum_attempts=5,
        non_retryable_error_types=["FabricRefused", "TenantNotFound", "TenantStateConflict"],
    ),
)

# Undoing a tenant step, and every step past the point of no return: retried for as long as it
# takes (a tenant is never left half-made or half-removed; operators see the retries in the UI).
TENANT_UNTIL_DONE = dict(
    start_to_close_timeout=timedelta(seconds=60),
    retry_policy=RetryPolicy(
        initial_interval=timedelta(milliseconds=500),
        backoff_coefficient=2.0,
        maximum_interval=timedelta(seconds=60),
        non_retryable_error_types=["TenantNotFound", "TenantStateConflict"],
    ),
)
