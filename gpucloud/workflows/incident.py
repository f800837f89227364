"""An incident (`docs/health.md`, "Incidents"): opened once per pull (its id names the node and
the fault's moment, so a re-sent pull joins it), it reads the node's history every `poll_s`
on a durable timer and writes each phase as the history shows it (detected, stabilized,
diagnosed, repaired, gated), until the node is back in the pool or gone to RMA; then it writes
the write-up. It waits at most `max_wait_s` and then closes as abandoned. A long wait goes on
in a new run (continue-as-new) so the history stays short."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from gpucloud.activities.incidents import IncidentActivities
    from gpucloud.models.incident_messages import IncidentClose, IncidentInput, IncidentProgress, IncidentRef
    from gpucloud.workflows.db_steps import db_step


@workflow.defn
class IncidentWorkflow:
    @workflow.run
    async def run(self, inp: IncidentInput) -> IncidentProgress:
        started_at = inp.started_at or workflow.now()
        if inp.incident_id is None:
            opened = await db_step(IncidentActivities.open_incident, inp)
        else:
            opened = IncidentProgress(incident_id=inp.incident_id, phase="stabilize", status="open")
        ref = IncidentRef(incident_id=opened.incident_id)
        if opened.status != "open":  # closed already (a start that found its row after the run ended)
            return opened
        deadline = started_at + timedelta(seconds=inp.max_wait_s)
        for _ in range(inp.looks_per_run):
            progress = await db_step(IncidentActivities.observe_incident, ref)
            if progress.ended:
                break
            left = (deadline - workflow.now()).total_seconds()
            if left <= 0:
                return await db_step(
                    IncidentActivities.close_incident, IncidentClose(incident_id=ref.incident_id, abandoned=True)
                )
            await workflow.sleep(min(inp.poll_s, left))
        else:
            workflow.continue_as_new(inp.model_copy(update={"incident_id": ref.incident_id, "started_at": started_at}))
        return await db_step(IncidentActivities.close_incident, IncidentClose(incident_id=ref.incident_id))
