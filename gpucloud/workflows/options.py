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


class LocalActivityOptions(TypedDict, total=False):
    """The same for `workflow.execute_local_activity_method` (a local activity has no heartbeat)."""

    start_to_close_timeout: timedelta
    schedule_to_close_timeout: timedelta
    retry_policy: RetryPolicy


def _ms(n: int) -> timedelta:
    return timedelta(milliseconds=n)


def _s(n: int) -> timedelta:
    return timedelta(seconds=n)


def _min(n: int) -> timedelta:
    return timedelta(minutes=n)


def _h(n: int) -> timedelta:
    return timedelta(hours=n)


def _options(
    run: timedelta,
    first: timedelta,
    cap: timedelta,
    *,
    attempts: int = 0,
    permanent: tuple[str, ...] = (),
    give_up_after: timedelta | None = None,
    heartbeat: timedelta | None = None,
) -> ActivityOptions:
    """One try may `run` that long; retry delays double from `first` up to `cap`; `attempts` 0
    retries until the step succeeds or `give_up_after` passes; `permanent` error types are never
    retried; a long step `heartbeat`s that often."""
    options: ActivityOptions = {
        "start_to_close_timeout": run,
        "retry_policy": RetryPolicy(
            initial_interval=first,
            backoff_coefficient=2.0,
            maximum_interval=cap,
            maximum_attempts=attempts,
            non_retryable_error_types=list(permanent),
        ),
    }
    if give_up_after is not None:
        options["schedule_to_close_timeout"] = give_up_after
    if heartbeat is not None:
        options["heartbeat_timeout"] = heartbeat
    return options


# One short DB transaction: retry transient errors (locked DB, lost connection) for a while.
# Run as a local activity (`workflows/db_steps.py`): in the worker that runs the workflow, with
# no activity task to schedule, match and complete and no workflow task to resume on.
_db = _options(_s(30), _ms(200), _s(10), give_up_after=_min(10))
DB = LocalActivityOptions(
    start_to_close_timeout=_db["start_to_close_timeout"],
    schedule_to_close_timeout=_db["schedule_to_close_timeout"],
    retry_policy=_db["retry_policy"],
)

# A host-agent action: minutes on real hardware, heartbeats while it waits; a few retries with
# growing delays, then the node goes to its state's failure target.
AGENT = _options(_min(20), _s(1), _s(30), attempts=6, permanent=("AgentActionFailed",), heartbeat=_s(30))

# A scheduled diagnose (`services/diagnostics.py`): short tests on an idle node; one retry, then
# it is recorded as not run, well within the node's diagnostic lease (`health.diag_lease_s`).
DIAGNOSE = _options(_min(15), _s(1), _s(30), attempts=2, permanent=("AgentActionFailed",), heartbeat=_s(30))

# One action on a batch of agents (bring-up): the activity retries each unreachable agent itself
# and reports the ones that stay silent, so Temporal retries only a lost worker or a crash.
AGENT_BATCH = _options(_min(30), _s(1), _s(30), attempts=5, heartbeat=_s(60))

# A power action through a node's BMC (`activities/bmc.py`): a power change waited for, a cycle
# is two, and after an on the agent's first heartbeat may be awaited (minutes of a host's boot).
# A few retries of an unreachable or failing BMC, then the error stands; a final error (wrong
# credentials, no such system, a power state that never follows) is not retried.
BMC_ATTEMPTS = 4
BMC = _options(_min(30), _s(2), _s(30), attempts=BMC_ATTEMPTS, heartbeat=_s(30))
# Handing a re-imaged node its config drive and waiting for its booted agent to enroll
# (`bmc.boot_wait_s`): a lost worker is noticed by the missing heartbeat; a token not redeemed in
# time is final (the node fails closed).
BMC_ENROLLMENT = _options(
    _min(30), _s(2), _s(30), attempts=BMC_ATTEMPTS, permanent=("AgentDidNotEnroll",), heartbeat=_s(60)
)

# A call to the billing ledger, a separate service that may be down for hours: retried with
# growing delays for as long as it takes (allocation events must get there, and usage for an
# allocation the ledger has not heard of waits in the agents' spools); a refusal is final.
LEDGER = _options(_s(60), _s(1), _s(60), permanent=("LedgerRefused", "LedgerNotConfigured"))

# Closing a period aggregates all of its usage (10 million events: about two minutes).
LEDGER_CLOSE: ActivityOptions = {**LEDGER, "start_to_close_timeout": _min(15), "heartbeat_timeout": _s(30)}

# Applying an allocation's fabric membership (a few calls to each fabric manager, then a
# read-back): a manager that is down or answers a read that differs is retried, but not past the
# nodes' reservation deadline (10 minutes): the allocation then fails closed. A refusal is final.
FABRIC_APPLY = _options(
    _s(60), _ms(500), _s(15), permanent=("FabricRefused", "AllocationNotFound", "NodeNotFound"), give_up_after=_min(4)
)

# Taking membership away is retried for as long as it takes: a node that keeps it must not go
# back to the pool (the workflow waits here before the node's release or drain goes on).
FABRIC_REMOVE = _options(_s(60), _ms(500), _s(30), permanent=("AllocationNotFound", "NodeNotFound"))

# A step of tenant onboarding (the SDN controller, the object store): an outage is waited out
# (the workflow holds its own deadline, hours, that an operator can extend); a refusal is final
# and the onboarding is undone rather than left half-made.
TENANT_STEP = _options(_s(60), _ms(500), _s(30), permanent=("FabricRefused", "TenantNotFound", "TenantStateConflict"))

# Undoing a tenant step, and every step past the point of no return: retried for as long as it
# takes (a tenant is never left half-made or half-removed; operators see the retries in the UI).
TENANT_UNTIL_DONE = _options(_s(60), _ms(500), _s(60), permanent=("TenantNotFound", "TenantStateConflict"))

# The reconciler's sweep: one pass over the nodes that need work; the next one comes soon anyway.
SWEEP = _options(_min(5), _s(1), _s(10), attempts=3, heartbeat=_s(30))

# A rollout's set-up (resolving the target, registering the swarm): short calls, retried a while.
ROLLOUT_SETUP = _options(
    _s(60), _ms(500), _s(10), permanent=("TargetUnresolvable", "VersionNotFound"), give_up_after=_min(10)
)

# A wave's prefetch moves the whole artifact: up to an hour, heartbeats while it waits, a few retries.
ROLLOUT_PREFETCH = _options(_h(1), _s(1), _s(30), attempts=4, heartbeat=_s(30))

# Verify re-hashes the files (minutes for 141 GB), activate re-verifies then switches; check is
# quick. Each reports per-node outcomes; Temporal retries only a lost worker.
ROLLOUT_STEP = _options(_min(30), _s(1), _s(30), attempts=3, heartbeat=_s(30))

# A rollback is retried for as long as it takes: a node left on a bad version is worse than a wait.
ROLLOUT_ROLLBACK = _options(_min(30), _s(1), _s(30), heartbeat=_s(30))
# A platform evaluation of a version (`activities/evaluation.py`), on the evaluation worker's
# task queue: pull it (and its parent), verify, run the evaluator. A store that is down is
# waited out. The evaluator's own failures (a command that hangs or crashes) are results, not
# errors, and are never retried; so are a version that fails verification or the disk budget.
EVALUATION = _options(_h(7), _s(2), _s(60), heartbeat=_min(2))

# The control plane's side of an evaluation: the tenant's keys before, the signed record after
# (DB and object store writes). A version not found, unverifiable or over the disk budget, or a
# token the API refused (it outlived its life), ends the evaluation there.
EVALUATION_RECORD = _options(
    _min(2),
    _s(1),
    _s(30),
    permanent=("VersionUnverifiable", "VersionNotFound", "EvaluationOverDiskBudget", "EvaluationAccessRefused"),
    give_up_after=_h(1),
)

# Making sure a pool's scheduler runs (a signal-with-start): Temporal itself, retried a while; the
# queued allocation's workflow asks again at its next recheck anyway.
SCHEDULER_POKE = _options(_s(30), _ms(500), _s(10), give_up_after=_min(2))

# A call to the ledger that must not hold up its caller's loop (the pool's scheduler records
# reservations): a few tries, then the next round tries again.
LEDGER_BRIEF = _options(_s(30), _s(1), _s(10), attempts=3, permanent=("LedgerRefused", "LedgerNotConfigured"))
