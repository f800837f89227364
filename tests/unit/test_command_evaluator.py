"""The command evaluator: real processes against a model directory; a failing, hanging or
garbage-printing command is a failed evaluation with its reason, never a pass."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from gpucloud.registry.command_eval import parse_metrics, run_command


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text('{"layers": 2}')
    return tmp_path


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_command_that_prints_its_metrics_passes_with_them(model_dir: Path) -> None:
    code = (
        "import json, os; layers = json.load(open(os.path.join(os.environ['GPUCLOUD_MODEL_DIR'], 'config.json')))"
        "['layers']; print('loading...'); print(json.dumps({'accuracy': 0.91, 'layers': layers}))"
    )
    outcome = run_command(python(code), model_dir, timeout_s=30, env={"EVAL_SPLIT": "test"})
    assert outcome.ok and outcome.metrics == {"accuracy": 0.91, "layers": 2.0} and outcome.exit_code == 0


def test_a_failing_command_fails_with_its_code_and_error(model_dir: Path) -> None:
    outcome = run_command(
        python("import sys; sys.stderr.write('CUDA out of memory'); sys.exit(3)"), model_dir, timeout_s=30
    )
    assert not outcome.ok and outcome.exit_code == 3 and "exited with 3: CUDA out of memory" in outcome.reason


def test_a_hanging_command_and_its_children_are_killed_at_the_time_limit(model_dir: Path) -> None:
    started = time.monotonic()
    code = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
    outcome = run_command(python(code), model_dir, timeout_s=1.5)
    assert not outcome.ok and "ran past its time limit of 1.5 s" in outcome.reason
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("printed", "why"),
    [
        ("print('accuracy: 0.9')", "not JSON"),
        ("print('[0.9]')", "not a JSON object"),
        ("print('{\"accuracy\": NaN}')", "not a finite number"),
        ('print(\'{"accuracy": "high"}\')', "not a finite number"),
        ("print('{\"ok\": true}')", "not a finite number"),
        ("pass", "printed nothing"),
    ],
)
def test_garbage_is_a_failed_evaluation_naming_what_was_printed(model_dir: Path, printed: str, why: str) -> None:
    outcome = run_command(python(printed), model_dir, timeout_s=30)
    assert not outcome.ok and why in outcome.reason, outcome.reason


def test_a_command_that_cannot_start_or_floods_its_output_fails(model_dir: Path) -> None:
    assert "could not start" in run_command(["/no/such/evaluator"], model_dir, timeout_s=5).reason
    flood = run_command(python("print('x' * (3 << 20))"), model_dir, timeout_s=30)
    assert not flood.ok and "more than 1048576" in flood.reason
    with pytest.raises(ValueError, match="more than 256"):
        parse_metrics("{" + ",".join(f'"m{i}": 1' for i in range(300)) + "}")
