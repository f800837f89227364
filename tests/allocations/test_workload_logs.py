"""Issue 40: the agent keeps a workload's stdout and stderr, bounded and rotated, and its exit
status, and reads them back for the control plane (`gpucloud.agent.workload_logs`,
`gpucloud.agent.workloads`). Before: the output went to one file that grew without bound, and an
agent restarted after the workload ended reported it with no exit code."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from gpucloud.agent import workload_logs
from gpucloud.agent.workload_logs import LogLimits, RotatingWriter
from gpucloud.agent.workloads import WorkloadSupervisor
from gpucloud.protocol.actions import Workload
from support.stack import wait_until

pytestmark = pytest.mark.unit


def test_output_is_rotated_and_bounded_to_files_times_max_bytes(tmp_path: Path) -> None:
    path = tmp_path / "workload-a1.log"
    limits = LogLimits(max_bytes=100, files=3)
    writer = RotatingWriter(path, limits)
    for i in range(60):
        writer.write(f"line {i:04d}\n".encode())  # 10 bytes each: 600 bytes in all
    writer.close()
    files = workload_logs.files_of(path, limits)
    assert [f.name for f in files] == ["workload-a1.log.2", "workload-a1.log.1", "workload-a1.log"]
    assert all(f.stat().st_size <= 100 for f in files)
    assert not (tmp_path / "workload-a1.log.3").exists()  # the oldest went
    kept = b"".join(f.read_bytes() for f in files)
    assert kept == b"".join(f"line {i:04d}\n".encode() for i in range(30, 60))


def test_tail_reads_across_rotated_files_and_is_bounded_in_lines_and_bytes(tmp_path: Path) -> None:
    path = tmp_path / "w.log"
    limits = LogLimits(max_bytes=100, files=3)
    writer = RotatingWriter(path, limits)
    for i in range(25):
        writer.write(f"line {i:04d}\n".encode())
    writer.close()
    assert workload_logs.tail(path, limits, lines=12) == b"".join(f"line {i:04d}\n".encode() for i in range(13, 25))
    assert workload_logs.tail(path, limits, lines=0) == b""
    # A byte bound smaller than the lines asked: whole lines only, the newest.
    bounded = workload_logs.tail(path, limits, lines=None, max_bytes=35)
    assert bounded == b"line 0022\nline 0023\nline 0024\n"
    assert workload_logs.tail(tmp_path / "none.log", limits, lines=5) == b""


def test_follow_reads_through_a_rotation_and_ends_when_the_workload_ends(tmp_path: Path) -> None:
    path = tmp_path / "w.log"
    limits = LogLimits(max_bytes=20, files=2)
    writer = RotatingWriter(path, limits)
    writer.write(b"before\n")
    steps = iter([b"one 0000000\n", b"two 0000000\n", b"three 00000\n"])  # the second rotates
    running = [True]

    def sleep(_: float) -> None:
        data = next(steps, None)
        if data is None:
            running[0] = False
        else:
            writer.write(data)

    got = b"".join(
        workload_logs.follow(
            path, since=len(b"before\n"), running=lambda: running[0], deadline_s=60, sleep=sleep, poll_s=0
        )
    )
    writer.close()
    assert got == b"one 0000000\ntwo 0000000\nthree 00000\n"


def test_follow_stops_at_its_deadline_while_the_workload_runs(tmp_path: Path) -> None:
    path = tmp_path / "w.log"
    path.write_bytes(b"x\n")
    clock = itertools.count(0.0, 1.0)
    got = list(
        workload_logs.follow(
            path, since=0, running=lambda: True, deadline_s=5, clock=lambda: next(clock), sleep=lambda _: None
        )
    )
    assert got == [b"x\n"]  # then nothing more, and it returned


@pytest.fixture
def supervisor(tmp_path: Path):
    made = WorkloadSupervisor(tmp_path / "workloads", grace_s=0.5, container_runtime="", log_limits=LogLimits(200, 2))
    yield made
    made.stop()


def _exited(supervisor: WorkloadSupervisor) -> dict:
    wait_until(lambda: supervisor.status()["workload"] == "exited", timeout_s=20, what="workload exit")
    return supervisor.status()


def test_the_workload_s_stdout_and_stderr_and_exit_code_are_kept(supervisor, tmp_path: Path) -> None:
    script = "echo to-stdout; echo to-stderr >&2; i=0; while [ $i -lt 50 ]; do echo line-$i; i=$((i+1)); done; exit 3"
    running = supervisor.start("a1", Workload(command=["sh", "-c", script]), cwd=tmp_path / "work")
    status = _exited(supervisor)
    assert status["exit_code"] == 3
    path = Path(running.log_path)
    wait_until(lambda: path.exists() and b"line-49\n" in path.read_bytes(), timeout_s=10, what="the last write")
    kept = b"".join(f.read_bytes() for f in workload_logs.files_of(path, supervisor.log_limits))
    assert kept.endswith(b"line-48\nline-49\n") and len(kept) <= 400  # two files of 200 bytes
    assert path.with_name(path.name + ".1").exists()  # it rotated
    assert workload_logs.tail(path, supervisor.log_limits, lines=2) == b"line-48\nline-49\n"


def test_an_agent_restarted_after_the_workload_ended_still_reports_its_exit_code(supervisor, tmp_path: Path) -> None:
    supervisor.start("a1", Workload(command=["sh", "-c", "echo done; exit 7"]), cwd=tmp_path / "work")
    assert _exited(supervisor)["exit_code"] == 7
    restarted = WorkloadSupervisor(supervisor.state_dir, container_runtime="")
    assert restarted.report().model_dump(include={"state", "exit_code"}) == {"state": "exited", "exit_code": 7}
