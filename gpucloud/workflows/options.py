"""Timeouts and retry policies for every activity the workflows call, in one place.

The rule (see docs/architecture.md): an outside system that is slow or down is waited out with
capped backoff; only an error that says the request itself cannot succeed fails a step, and it
is raised non-retryable with its own type (named in `non_retryable_error_types` below).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TypedDict

from temporalio.common import RetryPolicy


class ActivityOptions(TypedDict, total=False):
    """The keyword options of `workflow.execute_activity_method` that set timeouts and retries."""

    start_to_close_timeout: timedelta
    schedule_to_close_timeout: timedelta
    heartbeat_timeout: timedelta
    retry_policy: RetryPolicy


def _backoff(first: timedelta, cap: timedelta, *, attempts: int = 0, permanent: tuple[str, ...] = ()) -> RetryPolicy:
    """Delays doubling from `first` up to `cap`; `attempts` 0 retries until the step succeeds
    (or its schedule-to-close timeout passes); `permanent` error types are never retried."""
    return RetryPolicy(
        initial_interval=first,
        backoff_coefficient=2.0,
        maximum_interval=cap,
        maximum_attempts=attempts,
        non_retryable_error_types=list(permanent),
    )


# One short DB transaction: retry transient errors (locked DB, lost connection) for a while.
DB: ActivityOptions = {
    "start_to_close_timeout": timedelta(seconds=30),
    "schedule_to_close_timeout": timedelta(minutes=10),
    "retry_policy": _backoff(timedelta(milliseconds=200), timedelta(seconds=10)),
}

# A host-agent action: minutes on real hardware, heartbeats while it waits; a few retries with
# growing delays, then the node goes to its state's failure target.
AGENT: ActivityOptions = {
    "start_to_close_timeout": timedelta(minutes=20),
    "heartbeat_timeout": timedelta(seconds=30),
    "retry_policy": _backoff(timedelta(seconds=1), timedelta(seconds=30), attempts=6, permanent=("AgentActionFailed",)),
}

# One action on a batch of agents (bring-up): the activity retries each unreachable agent itself
# and reports the ones that stay silent, so Temporal retries only a lost worker or a crash.
AGENT_BATCH: ActivityOptions = {
    "start_to_close_timeout": timedelta(minutes=30),
    "heartbeat_timeout": timedelta(seconds=60),
    "retry_policy": _backoff(timedelta(seconds=1), timedelta(seconds=30), attempts=5),
}

# A call to the billing ledger, a separate service that may be down for hours: retried with
# growing delays for as long as it takes (allocation events must get there, and usage for an
# allocation the ledger has not heard of waits in the agents' spools); a refusal is final.
LEDGER: ActivityOptions = {
    "start_to_close_timeout": timedelta(seconds=60),
    "retry_policy": _backoff(
        timedelta(seconds=1), timedelta(seconds=60), permanent=("LedgerRefused", "LedgerNotConfigured")
    ),
}

# Closing a period aggregates all of its usage (10 million events: about two minutes).
LEDGER_CLOSE: ActivityOptions = {**LEDGER, "start_to_close_timeout": timedelta(minutes=15)}

# Applying an allocation's fabric membership (a few calls to each fabric manager, then a
# read-back): a manager that is down or answers a read that differs is retried, but not past the
# nodes' reservation deadline (10 minutes): the allocation then fails closed. A refusal is final.
FABRIC_APPLY: ActivityOptions = {
    "start_to_close_timeout": timedelta(seconds=60),
    "schedule_to_close_timeout": timedelta(minutes=4),
    "retry_policy": _backoff(
        timedelta(milliseconds=500),
        timedelta(seconds=15),
        permanent=("FabricRefused", "AllocationNotFound", "NodeNotFound"),
    ),
}

# Taking membership away is retried for as long as it takes: a node that keeps it must not go
# back to the pool (the workflow waits here before the node's release or drain goes on).
FABRIC_REMOVE: ActivityOptions = {
    "start_to_close_timeout": timedelta(seconds=60),
    "retry_policy": _backoff(
        timedelta(milliseconds=500), timedelta(seconds=30), permanent=("AllocationNotFound", "NodeNotFound")
    ),
}

# A step of tenant onboarding (the SDN controller, the object store): transient errors are
# retried a few times, then the onboarding is undone rather than left half-made.
TENANT_STEP: ActivityOptions = {
    "start_to_close_timeout": timedelta(seconds=60),
    "retry_policy": _backoff(
        timedelta(milliseconds=500),
        timedelta(seconds=10),
        attempts=5,
        permanent=("FabricRefused", "TenantNotFound", "TenantStateConflict"),
    ),
}

# Undoing a tenant step, and every step past the point of no return: retried for as long as it
# takes (a tenant is never left half-made or half-removed; operators see the retries in the UI).
TENANT_UNTIL_DONE: ActivityOptions = {
    "start_to_close_timeout": timedelta(seconds=60),
    "retry_policy": _backoff(
        timedelta(milliseconds=500), timedelta(seconds=60), permanent=("TenantNotFound", "TenantStateConflict")
    ),
}

# The reconciler's sweep: one pass over the nodes that need work; the next one comes soon anyway.
SWEEP: ActivityOptions = {
    "start_to_close_timeout": timedelta(minutes=5),
    "retry_policy": _backoff(timedelta(seconds=1), timedelta(seconds=10), attempts=3),
}

# A rollout's set-up (resolving the target, registering the swarm): short calls, retried a while.
ROLLOUT_SETUP: ActivityOptions = {
    "start_to_close_timeout": timedelta(seconds=60),
    "schedule_to_close_timeout": timedelta(minutes=10),
    "retry_policy": _backoff(
        timedelta(milliseconds=500), timedelta(seconds=10), permanent=("TargetUnresolvable", "VersionNotFound")
    ),
}

# A wave's prefetch moves the whole artifact: up to an hour, heartbeats while it waits, a few retries.
ROLLOUT_PREFETCH: ActivityOptions = {
    "start_to_close_timeout": timedelta(hours=1),
    "heartbeat_timeout": timedelta(seconds=30),
    "retry_policy": _backoff(timedelta(seconds=1), timedelta(seconds=30), attempts=4),
}

# Verify re-hashes the files (minutes for 141 GB), activate re-verifies then switches; check is
# quick. Each reports per-node outcomes; Temporal retries only a lost worker.
ROLLOUT_STEP: ActivityOptions = {
    "start_to_close_timeout": timedelta(minutes=30),
    "heartbeat_timeout": timedelta(seconds=30),
    "retry_policy": _backoff(timedelta(seconds=1), timedelta(seconds=30), attempts=3),
}

# A rollback is retried for as long as it takes: a node left on a bad version is worse than a wait.
ROLLOUT_ROLLBACK: ActivityOptions = {
    "start_to_close_timeout": timedelta(minutes=30),
    "heartbeat_timeout": timedelta(seconds=30),
    "retry_policy": _backoff(timedelta(seconds=1), timedelta(seconds=30)),
}
