"""A workload hang (issue 42): the tenant sets a progress timeout, its workload touches the file
the agent names in `$GPUCLOUD_PROGRESS_FILE`; one that runs on without touching it is reported
as a `workload_hang` signal (the workload's fault: counted, never a pull), once per stall. Real
processes, the real supervisor."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from gpucloud.agent.workloads import PROGRESS_ENV, WorkloadSupervisor
from gpucloud.health.signals import APPLICATION_SIGNALS
from gpucloud.protocol.actions import Workload
from gpucloud.protocol.reports import Signal
from support.stack import wait_until

pytestmark = pytest.mark.integration


def test_a_workload_that_stops_touching_its_progress_file_is_reported_hung_once_per_stall(tmp_path: Path) -> None:
    supervisor = WorkloadSupervisor(tmp_path / "workloads", grace_s=0.5)
    # Touches its progress file once at start, then sleeps: a collective that never returns.
    job = Workload(command=["sh", "-c", f'touch "${PROGRESS_ENV}"; touch touched; sleep 60'], progress_timeout_s=10)
    running = supervisor.start("alloc-1", job, cwd=tmp_path / "scratch")
    try:
        assert running.progress_file and Path(running.progress_file).is_file()
        wait_until(lambda: supervisor.status()["workload"] == "running", timeout_s=10, what="running")
        # Its one touch has happened (on a loaded machine the shell may start late): the stall
        # below is measured from that touch, not from the start.
        wait_until(lambda: (tmp_path / "scratch" / "touched").exists(), timeout_s=10, what="the workload's touch")
        assert supervisor.hung() is None  # within its timeout

        later = time.time() + 30
        hang = supervisor.hung(now=later)
        assert hang is not None and hang.signal == Signal.WORKLOAD_HANG and hang.source == "alloc-1"
        assert "timeout is 10 s" in hang.detail and hang.signal in APPLICATION_SIGNALS
        assert supervisor.hung(now=later + 5) is None  # the same stall, reported once

        os.utime(running.progress_file)  # progress again...
        assert supervisor.hung(now=time.time() + 5) is None
        assert supervisor.hung(now=time.time() + 40) is not None  # ...then a new stall
    finally:
        supervisor.stop()
    assert supervisor.hung(now=time.time() + 100) is None  # nothing runs: nothing hangs


def test_a_workload_without_a_timeout_is_never_reported_and_the_timeout_is_bounded(tmp_path: Path) -> None:
    supervisor = WorkloadSupervisor(tmp_path / "workloads", grace_s=0.5)
    supervisor.start("alloc-2", Workload(command=["sleep", "60"]), cwd=tmp_path / "scratch")
    try:
        assert supervisor.running().progress_file is None
        assert supervisor.hung(now=time.time() + 86_400) is None
    finally:
        supervisor.stop()
    with pytest.raises(ValidationError, match="progress_timeout_s"):
        Workload(command=["train"], progress_timeout_s=1)
