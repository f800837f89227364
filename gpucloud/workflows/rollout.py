"""A staged rollout of one model version to a set of nodes (`rollout-<id>`, `POST /v1/rollouts`).

The target is a list of nodes, an allocation, or the tenant's serving fleet (the last two
resolved by an activity); `plan_waves` cuts it into waves, canary -> 10% -> 50% -> 100% by
default. The rollout registers one swarm with the tracker for every target node, so nodes of
later waves fetch from those of earlier ones. Each wave:

1. prefetch: fetch and assemble the version on the wave's nodes. The next wave's prefetch starts
   as soon as this wave's is done (`prefetch_ahead`), so it runs while this wave bakes;
2. verify: every node re-hashes the assembled files against the signed manifest;
3. activate: an atomic switch on each node, the version it replaces kept as `previous`;
4. bake: wait `bake_s` (a durable timer; a worker restart does not shorten or restart it);
5. check: every node activated so far must be healthy, and its evaluation probe must score at
   least `thresholds.min_eval_score`. The first wave's check (the canary's) also runs the
   model's evaluations on its nodes (`evaluation`: the weight-sanity evaluator against the
   version each node ran before, the model's command) and holds them to the model's gates.

Every step re-reads its nodes from the control-plane DB before it sends anything
(`gpucloud.activities.rollout`); a node no longer in the tenant's allocation comes back `dropped`,
is recorded in the progress (`dropped`, with the reason) and is left out of every later step,
rollback included. Losing a node that way is not a failure of the rollout.

Any failure (a step that fails on any node, a check below threshold or a failing gate) rolls back EVERY node the
rollout tried to activate, and the rollout ends `rolled_back` with the reason. Rollback names the
version it undoes, so it is a no-op on a node that never switched, and it is retried until every
node has answered.

Updates: `pause` holds the rollout at the next wave boundary (a wave under way finishes, bake
and check included); `resume` lets it go on; `abort` stops it at once, whatever the step (the
running activity is cancelled), rolls back what was activated, and answers with the final
progress. Validators refuse these on a finished rollout. `progress` is the query the API and the
CLI read; the search attributes ModelVersion, TenantId (and AllocationId for an allocation's
rollout) let operators find rollouts in the Web UI.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    import gpucloud.workflows.options as options
    from gpucloud.activities.rollout import RolloutActivities
    from gpucloud.models import search_attributes as sa
    from gpucloud.models.rollout_messages import (
        FINISHED,
        PrepareInput,
        ReasonInput,
        ResolveTargetsInput,
        RolloutInput,
        RolloutPhase,
        RolloutProgress,
        RolloutResult,
        RolloutTarget,
        WaveInput,
        WaveResult,
        plan_waves,
    )


class _Stop(Exception):
    """The rollout must roll back: the reason is the message."""


@workflow.defn
class RolloutWorkflow:
    def __init__(self) -> None:
        self._progress: RolloutProgress | None = None
        self._paused = False
        self._abort: str | None = None
        self._attempted: list[RolloutTarget] = []  # nodes sent an activate: rollback covers them all
        self._prefetches: dict[int, workflow.ActivityHandle] = {}
        self._swarm = ""  # registered with the tracker once prepared

    @property
    def _running(self) -> RolloutProgress:
        """The progress of a run under way (set as the run starts)."""
        assert self._progress is not None, "the rollout has not started"
        return self._progress

    # Run ----------------------------------------------------------------------------------------

    @workflow.run
    async def run(self, inp: RolloutInput) -> RolloutResult:
        self._inp = inp
        self._progress = RolloutProgress(
            rollout_id=inp.rollout_id,
            tenant_id=inp.tenant_id,
            model_version=inp.model_version,
            phase=RolloutPhase.RESOLVING,
        )
        attributes = [sa.MODEL_VERSION.value_set(inp.model_version), sa.TENANT_ID.value_set(inp.tenant_id)]
        if inp.allocation_id:
            attributes.append(sa.ALLOCATION_ID.value_set(inp.allocation_id))
        workflow.upsert_search_attributes(attributes)
        try:
            nodes = await self._targets(inp)
            waves = plan_waves([n.node_id for n in nodes], inp.waves)
            self._running.waves = waves
            by_id = {n.node_id: n for n in nodes}
            prepared = await workflow.execute_activity_method(
                RolloutActivities.prepare_rollout,
                PrepareInput(
                    rollout_id=inp.rollout_id, tenant_id=inp.tenant_id, model_version=inp.model_version, nodes=nodes
                ),
                **options.ROLLOUT_SETUP,
            )
        except ActivityError as error:
            return await self._finish(RolloutPhase.FAILED, _reason(error))
        self._swarm = prepared.swarm
        self._waves = [[by_id[n] for n in wave] for wave in waves]
        try:
            for index in range(len(self._waves)):
                await self._wave(index)
        except _Stop as stop:
            await self._roll_back(str(stop))
            return await self._finish(RolloutPhase.ROLLED_BACK, str(stop))
        return await self._finish(RolloutPhase.SUCCEEDED, "")

    async def _targets(self, inp: RolloutInput) -> list[RolloutTarget]:
        if inp.nodes is not None:
            return inp.nodes
        resolved = await workflow.execute_activity_method(
            RolloutActivities.resolve_rollout_targets,
            ResolveTargetsInput(tenant_id=inp.tenant_id, allocation_id=inp.allocation_id),
            **options.ROLLOUT_SETUP,
        )
        return resolved.nodes

    async def _wave(self, index: int) -> None:
        progress, nodes = self._running, self._waves[index]
        await self._hold_while_paused()
        progress.wave = index + 1
        progress.phase = RolloutPhase.PREFETCHING
        prefetched = await self._race(self._prefetch(index), "prefetch")
        progress.prefetched += [o.node_id for o in prefetched.outcomes]
        if self._inp.prefetch_ahead and index + 1 < len(self._waves):
            self._prefetch(index + 1)  # runs while this wave verifies, activates and bakes

        progress.phase = RolloutPhase.VERIFYING
        self._require(await self._race(self._start(RolloutActivities.verify_wave, nodes), "verify"), "verify")

        progress.phase = RolloutPhase.ACTIVATING
        self._attempted += nodes
        activated = await self._race(self._start(RolloutActivities.activate_wave, nodes), "activate")
        progress.activated += [o.node_id for o in activated.outcomes if o.ok]
        self._require(activated, "activate")

        progress.phase = RolloutPhase.BAKING
        with contextlib.suppress(TimeoutError):
            await workflow.wait_condition(lambda: self._abort is not None, timeout=timedelta(seconds=self._inp.bake_s))
        self._stop_if_aborted()

        progress.phase = RolloutPhase.CHECKING
        # The canary's check (the first wave's) also runs the model's evaluations on its nodes.
        check = self._start(RolloutActivities.check_wave, self._attempted, evaluate=index == 0)
        self._require(await self._race(check, "check"), "check")

    # Steps --------------------------------------------------------------------------------------

    def _request(self, nodes: list[RolloutTarget], *, evaluate: bool = False) -> WaveInput:
        inp, dropped = self._inp, self._running.dropped
        return WaveInput(
            rollout_id=inp.rollout_id,
            tenant_id=inp.tenant_id,
            model_version=inp.model_version,
            swarm=self._swarm,
            nodes=[n for n in nodes if n.node_id not in dropped],
            thresholds=inp.thresholds,
            evaluation=inp.evaluation if evaluate else None,
        )

    def _start(
        self,
        activity: Callable[[RolloutActivities, WaveInput], Awaitable[WaveResult]],
        nodes: list[RolloutTarget],
        *,
        evaluate: bool = False,
    ) -> workflow.ActivityHandle[WaveResult]:
        request = self._request(nodes, evaluate=evaluate)
        return workflow.start_activity_method(activity, request, **options.ROLLOUT_STEP)

    def _prefetch(self, index: int) -> workflow.ActivityHandle:
        if index not in self._prefetches:
            self._prefetches[index] = workflow.start_activity_method(
                RolloutActivities.prefetch_wave, self._request(self._waves[index]), **options.ROLLOUT_PREFETCH
            )
        return self._prefetches[index]

    async def _race(self, handle: workflow.ActivityHandle, step: str) -> WaveResult:
        """The step's result, unless an abort comes first: then the step is cancelled."""
        aborted = asyncio.ensure_future(workflow.wait_condition(lambda: self._abort is not None))
        await workflow.wait([handle, aborted], return_when=asyncio.FIRST_COMPLETED)
        if not handle.done():
            handle.cancel()
            self._stop_if_aborted()
        aborted.cancel()
        try:
            result = handle.result()
        except ActivityError as error:
            raise _Stop(f"wave {self._running.wave} {step}: {_reason(error)}") from None
        self._running.dropped.update(result.dropped)
        return result

    def _require(self, result: WaveResult, step: str) -> None:
        for outcome in result.outcomes:
            earlier = self._running.outcomes.get(outcome.node_id)
            if earlier is not None and earlier.evaluations and not outcome.evaluations:
                # What the canary's evaluations found stays in its progress after later checks.
                outcome = outcome.model_copy(update={"evaluations": earlier.evaluations})
            self._running.outcomes[outcome.node_id] = outcome
        if failed := result.failed:
            names = ", ".join(o.node_id for o in failed[:5]) + (" ..." if len(failed) > 5 else "")
            raise _Stop(
                f"wave {self._running.wave} {step} failed on {len(failed)} node(s) ({names}): {failed[0].detail}"
            )
        self._stop_if_aborted()

    def _stop_if_aborted(self) -> None:
        if self._abort is not None:
            raise _Stop(f"aborted: {self._abort}")

    async def _hold_while_paused(self) -> None:
        if self._paused:
            self._running.phase = RolloutPhase.PAUSED
            await workflow.wait_condition(lambda: not self._paused or self._abort is not None)
        self._stop_if_aborted()

    async def _roll_back(self, reason: str) -> None:
        self._running.phase, self._running.reason = RolloutPhase.ROLLING_BACK, reason
        for handle in self._prefetches.values():
            if not handle.done():
                handle.cancel()
        if not self._attempted:
            return
        result = await workflow.execute_activity_method(
            RolloutActivities.rollback_wave, self._request(self._attempted), **options.ROLLOUT_ROLLBACK
        )
        self._running.dropped.update(result.dropped)
        self._running.rolled_back = [o.node_id for o in result.outcomes]
        for outcome in result.outcomes:
            earlier = self._running.outcomes.get(outcome.node_id)
            if earlier is not None and earlier.evaluations and not outcome.evaluations:
                # What the canary's evaluations found stays in its progress after later checks.
                outcome = outcome.model_copy(update={"evaluations": earlier.evaluations})
            self._running.outcomes[outcome.node_id] = outcome

    async def _finish(self, phase: RolloutPhase, reason: str) -> RolloutResult:
        progress = self._running
        if self._swarm:
            # The swarm goes with the rollout: its nodes' tokens open nothing more. A tracker that
            # stays down past the retries leaves a row an operator may delete; the outcome stands.
            try:
                await workflow.execute_activity_method(
                    RolloutActivities.end_rollout, self._swarm, **options.ROLLOUT_SETUP
                )
            except ActivityError as error:
                workflow.logger.warning("the tracker kept swarm %s: %s", self._swarm, _reason(error))
        progress.phase, progress.reason = phase, reason
        await workflow.wait_condition(workflow.all_handlers_finished)
        return RolloutResult(
            rollout_id=progress.rollout_id,
            status=phase,
            reason=reason,
            activated=progress.activated,
            rolled_back=progress.rolled_back,
        )

    # Query and updates ----------------------------------------------------------------------

    @workflow.query
    def progress(self) -> RolloutProgress:
        return self._snapshot()

    def _snapshot(self) -> RolloutProgress:
        return self._running.model_copy(update={"paused": self._paused}, deep=True)

    @workflow.update
    def pause(self, req: ReasonInput) -> RolloutProgress:
        self._paused = True
        return self._snapshot()

    @workflow.update
    def resume(self, req: ReasonInput) -> RolloutProgress:
        self._paused = False
        return self._snapshot()

    @workflow.update
    async def abort(self, req: ReasonInput) -> RolloutProgress:
        if self._abort is None:
            self._abort = req.reason or "aborted on request"
        await workflow.wait_condition(lambda: self._progress is not None and self._progress.phase in FINISHED)
        return self._snapshot()

    @pause.validator
    def _can_pause(self, req: ReasonInput) -> None:
        self._refuse_if_over("pause")

    @resume.validator
    def _can_resume(self, req: ReasonInput) -> None:
        self._refuse_if_over("resume")

    @abort.validator
    def _can_abort(self, req: ReasonInput) -> None:
        if self._progress is not None and self._progress.phase in FINISHED:
            raise ValueError(f"the rollout is already {self._progress.phase.value}")

    def _refuse_if_over(self, command: str) -> None:
        if self._progress is None:
            return
        if self._progress.phase in FINISHED:
            raise ValueError(f"cannot {command}: the rollout is already {self._progress.phase.value}")
        if self._abort is not None:
            raise ValueError(f"cannot {command}: the rollout is being aborted")


def _reason(error: ActivityError) -> str:
    cause = error.cause
    return f"{error.activity_type} failed: {getattr(cause, 'message', None) or cause or error}"
