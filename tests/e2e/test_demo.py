"""The whole stack through the public API: `gpucloud demo` as a newcomer runs it."""

from __future__ import annotations

import subprocess
import sys


def test_demo_runs_end_to_end(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "gpucloud.cli", "demo", "--nodes", "6", "--data-dir", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=400,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "demo succeeded" in output
    assert "allocation ready" in output and "allocation released" in output
    # The stack was stopped: nothing of it keeps running (its ports are free again).
    assert "'available': 6" in output
