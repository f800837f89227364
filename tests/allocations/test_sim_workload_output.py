"""Issue 40: a simulated node's workload prints and ends as its command says, synthesized, never
run (`sim/workload_output.py`): the simulated fleet lives beside platform secrets."""

from __future__ import annotations

import asyncio

import pytest

from gpucloud.protocol.actions import Workload
from gpucloud.sim.workload_output import STEP_S, follow_text, simulate, tail_text

pytestmark = pytest.mark.unit


def test_a_script_of_simple_steps_is_played_to_its_end_with_its_status() -> None:
    script = "echo start $RUN ${GPUCLOUD_ALLOCATION_ID}; false && echo never; sleep 2; echo done >&2; exit 5"
    run = simulate(Workload(command=["sh", "-c", script], env={"RUN": "r1"}), allocation_id="a1")
    assert run.status(1.0) == ("running", None) and run.status(2.0) == ("exited", 5)
    assert tail_text(run, 1.0, lines=None) == ("start r1 a1\n", 1)
    assert tail_text(run, 3.0, lines=None) == ("start r1 a1\ndone\n", 2)
    assert tail_text(run, 3.0, lines=1) == ("done\n", 2)
    echo = simulate(Workload(command=["echo", "hi", "there"]), allocation_id="a1")
    assert echo.status(0.0) == ("exited", 0) and tail_text(echo, 0.0, lines=None)[0] == "hi there\n"


def test_anything_else_is_a_long_job_printing_steps_until_released_and_nothing_is_run(tmp_path) -> None:
    marker = tmp_path / "ran"
    run = simulate(Workload(command=["sh", "-c", f"touch {marker}; python train.py"]), allocation_id="a1")
    assert run.status(1e6) == ("running", None)
    text, printed = tail_text(run, 3 * STEP_S, lines=2)
    assert printed == 3 and text.startswith("step 2 loss ") and text.count("\n") == 2
    assert not marker.exists()  # synthesized, never executed
    assert simulate(Workload(image="train:1"), allocation_id="a1").status(5.0) == ("running", None)


def test_a_follow_streams_new_lines_and_ends_at_the_run_s_end() -> None:
    run = simulate(Workload(command=["sh", "-c", "echo a; sleep 1; echo b"]), allocation_id="a1")
    now = [0.0]

    def clock() -> float:
        now[0] += 0.25
        return now[0]

    async def read() -> list[str]:
        follow = follow_text(run, 0.0, since=1, deadline_s=60, running=lambda: True, clock=clock, poll_s=0)
        return [text async for text in follow]

    assert asyncio.run(read()) == ["b\n"]
