"""What a caller of the API is told when the workflow engine (Temporal) refuses a call.

Two kinds of refusal, two answers. An engine that is down, slow or shedding load (UNAVAILABLE,
which is also a refused connection, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED) is waited
out: 503 with `Retry-After`, and the same request succeeds later; so is an update to a workflow
whose workers are not polling (down or restarting). Every other refusal is the
deployment's, and no retry fixes it: a namespace that was never registered (NOT_FOUND), a search
attribute the namespace does not map (INVALID_ARGUMENT), credentials the engine does not accept
(PERMISSION_DENIED, UNAUTHENTICATED). That is a 500 whose detail carries the engine's own message
and the fix, logged at error level with the same cause, and it never says retry: a client that
retried it would only hide it.
"""

from __future__ import annotations

import logging

from temporalio.service import RPCError, RPCStatusCode

from gpucloud.services.errors import Broken, DomainError, Unavailable

log = logging.getLogger(__name__)

WAITED_OUT = frozenset(
    {
        RPCStatusCode.UNAVAILABLE,  # also a connection refused or lost
        RPCStatusCode.DEADLINE_EXCEEDED,
        RPCStatusCode.RESOURCE_EXHAUSTED,  # rate limits, the namespace's poller limit
        RPCStatusCode.ABORTED,  # a conflict inside the engine; the next try runs alone
    }
)

# The refusals a prepared deployment does not get: what `gpucloud prepare` makes is missing.
_UNPREPARED = frozenset({RPCStatusCode.NOT_FOUND, RPCStatusCode.INVALID_ARGUMENT, RPCStatusCode.FAILED_PRECONDITION})
_CREDENTIALS = frozenset({RPCStatusCode.PERMISSION_DENIED, RPCStatusCode.UNAUTHENTICATED})


def waited_out(exc: RPCError) -> bool:
    """True when the engine did not answer (or shed the call), so the same call can succeed later.
    An update (a rollout's pause, resume or abort) finds no worker polling its task queue while
    the workers are down or restarting: the engine says FAILED_PRECONDITION, but that is an outage
    of the workers, waited out like the engine's own, not the deployment's setup."""
    no_worker = exc.status == RPCStatusCode.FAILED_PRECONDITION and "no poller seen" in exc.message
    return exc.status in WAITED_OUT or no_worker


def _fix(status: RPCStatusCode) -> str:
    if status in _UNPREPARED:
        return (
            "run `gpucloud prepare` with this deployment's settings (it registers the Temporal namespace "
            "and the search attributes the workflows set), or correct GPUCLOUD_TEMPORAL__NAMESPACE"
        )
    if status in _CREDENTIALS:
        return "give the API credentials the engine accepts for this namespace (GPUCLOUD_TEMPORAL__*)"
    return "see the Temporal server's log for this call"


def log_undelivered(logger: logging.Logger, exc: RPCError, what: str, meanwhile: str) -> None:
    """A call the request does without (a signal whose intent the DB holds too): a warning when
    the engine did not answer, an error naming the cause and the fix when it refused for good."""
    if waited_out(exc):
        logger.warning("%s not delivered (%s); %s", what, exc, meanwhile)
        return
    cause = f"{exc.message.rstrip('.')} ({exc.status.name})"
    logger.error("%s refused by the workflow engine: %s; %s; %s", what, cause, meanwhile, _fix(exc.status))


def engine_error(exc: RPCError, *, what: str, left: str) -> DomainError:
    """The refusal to raise for a call the engine refused: `what` names the call ("the
    onboarding"), `left` what the request left behind and how to resend it ("nothing was kept").
    An outage is `Unavailable` (503, `Retry-After`); a deployment's mistake is `Broken` (500)
    naming the engine's cause and the fix, logged at error level."""
    if waited_out(exc):
        return Unavailable(
            f"the workflow engine did not take {what}; {left}; retry",
            type_="workflow-engine-unavailable",
            retry_after_s=1,
            retryable=True,
        )
    cause = f"{exc.message.rstrip('.')} ({exc.status.name})"
    fix = _fix(exc.status)
    log.error("the workflow engine refused %s: %s; %s", what, cause, fix)
    return Broken(
        f"the workflow engine refused {what}: {cause}; {left}. This is the deployment's setup, not an "
        f"outage: {fix}, then send the request again",
        type_="workflow-engine-misconfigured",
        title="Workflow service misconfigured",
        retryable=False,
    )
