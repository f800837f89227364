"""`gpucloud demo` reports a failed step clearly and exits non-zero, whichever part failed."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from gpucloud.client.api import ApiError, ApiTimeout
from gpucloud.demo import main as demo
from gpucloud.demo.common import DemoFailed

pytestmark = pytest.mark.unit


class _QuietStack:
    """Stands in for the stack: nothing to start, nothing to stop."""

    stopped = False

    def __init__(self, settings, **kw) -> None:
        self.ui_url, self.log_dir = "http://ui", "/tmp/logs"

    def start(self, on_step) -> None:
        on_step("started")

    def stop(self) -> None:
        _QuietStack.stopped = True


@pytest.mark.parametrize(
    "error",
    [
        DemoFailed("allocation a1 failed: no replacement"),
        DemoFailed("the ledger total differs from what was metered"),
        ApiError(409, {"title": "Quota exceeded", "detail": "8 of 8 H100 GPUs in use"}),
        ApiTimeout("allocation a1 ready not reached within 180 s"),
    ],
)
def test_a_failing_scenario_step_is_reported_and_exits_non_zero(monkeypatch, tmp_path, error):
    def failing_scenario(*args, **kw):
        raise error

    monkeypatch.setattr(demo, "Stack", _QuietStack)
    monkeypatch.setattr(demo, "scenario", failing_scenario)
    out = io.StringIO()
    code = demo.run_demo(nodes=2, data_dir=tmp_path / "demo", console=Console(file=out, width=200))
    assert code == 1
    assert f"demo failed: {error}" in out.getvalue() and "logs: /tmp/logs" in out.getvalue()
    assert _QuietStack.stopped
