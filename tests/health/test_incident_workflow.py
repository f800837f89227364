"""`IncidentWorkflow` with its activities stood in for: opened once per pull (a re-sent pull joins
the running one, and one that ended is not opened again), it looks at the node's history on a
durable timer until the incident ends, then writes it up; it gives up after its maximum wait and
closes as abandoned; a run past its looks goes on in a new run with the same incident. A fleet
incident (a correlated burst, a breaker trip) is followed under its own id from the row its cause
wrote."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from gpucloud.activities.incidents import IncidentActivities
from gpucloud.adapters.temporal_gateway import start_incident
from gpucloud.config import Settings
from gpucloud.models import workflow_ids as ids
from gpucloud.models.incident_messages import IncidentClose, IncidentInput, IncidentProgress
from gpucloud.workflows.incident import IncidentWorkflow
from support.workflow_runs import StandIns, in_turn, queue_name, workers
from support.workflow_tier import RUN_TIMEOUT

pytestmark = pytest.mark.workflow

DETECTED = datetime(2026, 12, 6, 10, 0, tzinfo=UTC)


def _progress(phase: str, *, status: str = "open", ended: bool = False) -> IncidentProgress:
    return IncidentProgress(incident_id="inc_1", phase=phase, status=status, ended=ended)


def _closed(req: IncidentClose) -> IncidentProgress:
    return _progress("closed", status="abandoned" if req.abandoned else "resolved")


def _stand_ins(observed) -> StandIns:
    return StandIns(
        {
            IncidentActivities.open_incident: _progress("stabilize"),
            IncidentActivities.observe_incident: observed,
            IncidentActivities.close_incident: _closed,
        }
    )


def _input(node_id: str, **changes) -> IncidentInput:
    return IncidentInput(**{"node_id": node_id, "detected_at": DETECTED, "poll_s": 0.05, "max_wait_s": 20, **changes})


async def _run(client, stand_ins: StandIns, inp: IncidentInput) -> IncidentProgress:
    queue = queue_name("incident")
    async with workers(client, [IncidentWorkflow], {queue: stand_ins.for_worker()}):
        return await client.execute_workflow(
            IncidentWorkflow.run, inp, id=f"{queue}-run", task_queue=queue, execution_timeout=RUN_TIMEOUT
        )


async def test_it_follows_the_phases_until_the_incident_ends_then_writes_it_up(temporal_env) -> None:
    stand_ins = _stand_ins(in_turn(_progress("stabilize"), _progress("repair"), _progress("write_up", ended=True)))

    result = await _run(temporal_env.client, stand_ins, _input("n1"))

    assert result.status == "resolved"
    assert stand_ins.names == ["open_incident"] + ["observe_incident"] * 3 + ["close_incident"]
    assert stand_ins.args(IncidentActivities.close_incident) == [IncidentClose(incident_id="inc_1")]
    assert stand_ins.args(IncidentActivities.open_incident)[0].node_id == "n1"


async def test_it_gives_up_after_its_longest_wait_and_closes_as_abandoned(temporal_env) -> None:
    stand_ins = _stand_ins(_progress("repair"))

    result = await _run(temporal_env.client, stand_ins, _input("n2", max_wait_s=0.3))

    assert result.status == "abandoned"
    assert stand_ins.args(IncidentActivities.close_incident) == [IncidentClose(incident_id="inc_1", abandoned=True)]
    # A look every 0.05 s until 0.3 s after the start (how many depends on the machine's load).
    assert 1 <= stand_ins.names.count("observe_incident") <= 10


async def test_an_incident_found_closed_is_not_followed_again(temporal_env) -> None:
    stand_ins = _stand_ins(_progress("repair"))
    stand_ins.answers[IncidentActivities.open_incident] = _progress("closed", status="resolved")

    result = await _run(temporal_env.client, stand_ins, _input("n3"))

    assert result.status == "resolved" and stand_ins.names == ["open_incident"]


async def test_a_long_wait_goes_on_in_a_new_run_with_the_same_incident(temporal_env) -> None:
    stand_ins = _stand_ins(in_turn(_progress("repair"), _progress("write_up", ended=True)))
    queue = queue_name("incident")
    async with workers(temporal_env.client, [IncidentWorkflow], {queue: stand_ins.for_worker()}):
        handle = await temporal_env.client.start_workflow(
            IncidentWorkflow.run,
            _input("n4", looks_per_run=1),
            id=f"{queue}-run",
            task_queue=queue,
            execution_timeout=RUN_TIMEOUT,
        )
        result = await handle.result()
        last = await temporal_env.client.get_workflow_handle(handle.id).describe()

    assert result.status == "resolved"
    assert last.run_id != handle.first_execution_run_id  # continued as new after its one look
    # One open; the second run starts from the incident it was handed.
    assert stand_ins.names == ["open_incident", "observe_incident", "observe_incident", "close_incident"]


async def test_a_pull_sent_again_joins_the_running_incident_and_an_ended_one_is_not_reopened(temporal_env) -> None:
    node_id = f"n-{uuid.uuid4().hex[:8]}"
    queue = queue_name("incident")
    settings = Settings(temporal={"task_queue": queue})
    stand_ins = _stand_ins(in_turn(_progress("repair"), _progress("repair"), _progress("write_up", ended=True)))
    inp = _input(node_id, key_at=DETECTED, poll_s=0.05)
    async with workers(temporal_env.client, [IncidentWorkflow], {queue: stand_ins.for_worker()}):
        first = await start_incident(temporal_env.client, settings, inp)
        again = await start_incident(temporal_env.client, settings, inp.model_copy(update={"reason": "re-sent"}))
        assert first == again == ids.incident_workflow_id(node_id, DETECTED)
        await temporal_env.client.get_workflow_handle(first).result()
        assert await start_incident(temporal_env.client, settings, inp) == first  # ended: not opened again
    assert stand_ins.names.count("open_incident") == 1
    assert stand_ins.names.count("close_incident") == 1


async def test_a_fleet_incident_is_followed_under_its_own_id_from_the_row_its_cause_wrote(temporal_env) -> None:
    """A burst's (or a trip's) row is written where it is recognized: the workflow opens nothing,
    looks until the incident ends and closes it; a second start (the health loop again, the
    reconciler's sweep) joins the one running, and one that ended is not started again."""
    fleet_incident_id = f"fi-{uuid.uuid4().hex[:8]}"
    queue = queue_name("incident")
    settings = Settings(temporal={"task_queue": queue})
    stand_ins = _stand_ins(in_turn(_progress("repair"), _progress("gate"), _progress("write_up", ended=True)))
    inp = _input(
        "n5",
        kind="fleet",
        workflow_id=ids.fleet_incident_workflow_id(fleet_incident_id),
        incident_id="inc_1",
    )
    async with workers(temporal_env.client, [IncidentWorkflow], {queue: stand_ins.for_worker()}):
        first = await start_incident(temporal_env.client, settings, inp)
        assert first == f"incident-fleet-{fleet_incident_id}"
        assert await start_incident(temporal_env.client, settings, inp) == first
        result = await temporal_env.client.get_workflow_handle(first, result_type=IncidentProgress).result()
        assert await start_incident(temporal_env.client, settings, inp) == first  # ended: not again
    assert result.status == "resolved"
    assert stand_ins.names == ["observe_incident"] * 3 + ["close_incident"]
    assert stand_ins.args(IncidentActivities.close_incident) == [IncidentClose(incident_id="inc_1")]
