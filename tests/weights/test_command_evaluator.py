"""The command evaluator: real processes against a model directory; a failing, hanging or
garbage-printing command is a failed evaluation with its reason, never a pass."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from gpucloud.registry.command_eval import parse_metrics, run_command

pytestmark = pytest.mark.unit


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


def test_a_command_with_an_image_runs_in_the_container_runtime_without_network_reading_the_version(
    model_dir: Path, tmp_path: Path
) -> None:
    """Through a runtime with docker's CLI (`support.container_runtime`): the version mounted
    read-only at /model, no network, the model's env; its last line is the metrics."""
    from gpucloud.models.registry_tables import EvaluationCommand
    from gpucloud.registry.evaluators import run_model_command
    from support.container_runtime import write_runtime

    runtime = write_runtime(tmp_path / "runtime", images=["registry.example/eval:1"])
    code = (
        "import json, os; layers = json.load(open(os.path.join(os.environ['GPUCLOUD_MODEL_DIR'], 'config.json')))"
        "['layers']; print(json.dumps({'layers': layers, 'split': float(os.environ['SPLIT'])}))"
    )
    command = EvaluationCommand(argv=python(code), image="registry.example/eval:1", env={"SPLIT": "2"}, timeout_s=30)
    outcome = run_model_command(command, model_dir, runtime=runtime, host_commands=False)
    assert outcome.failure is None and outcome.results == {"layers": 2.0, "split": 2.0}
    [call] = [json.loads(line) for line in (tmp_path / "runtime" / "calls.jsonl").read_text().splitlines()]
    assert call[:2] == ["run", "--rm"] and "--network" in call and call[call.index("--network") + 1] == "none"
    assert f"{model_dir}:/model:ro" in call and "GPUCLOUD_MODEL_DIR=/model" in call
    assert call[call.index("--") + 1 :] == ["registry.example/eval:1", *command.argv]  # options end before it

    missing = command.model_copy(update={"image": "registry.example/other:2"})
    failed = run_model_command(missing, model_dir, runtime=runtime, host_commands=False)
    assert failed.failure == "the container runtime could not run the command (exit 125)"  # not its stderr
    nowhere = run_model_command(command, model_dir, runtime=str(tmp_path / "no-such-runtime"), host_commands=False)
    assert nowhere.failure is not None and "no container runtime" in nowhere.failure


def test_a_command_without_an_image_runs_on_the_host_only_where_allowed(model_dir: Path) -> None:
    from gpucloud.models.registry_tables import EvaluationCommand
    from gpucloud.registry.evaluators import run_model_command

    command = EvaluationCommand(argv=python("print('{\"ok\": 1}')"), timeout_s=30)
    refused = run_model_command(command, model_dir, runtime=None, host_commands=False)
    assert refused.results == {} and "only in containers" in (refused.failure or "")
    allowed = run_model_command(command, model_dir, runtime=None, host_commands=True)
    assert allowed.failure is None and allowed.results == {"ok": 1.0}


def test_a_failed_container_command_quotes_its_own_output_never_the_runtimes(model_dir: Path, tmp_path: Path) -> None:
    """The runtime's client writes its own errors to the standard error the container's goes to:
    the tenant sees the end of the command's standard output and its exit code, nothing else."""
    from gpucloud.models.registry_tables import EvaluationCommand
    from gpucloud.registry.evaluators import run_model_command
    from support.container_runtime import write_runtime

    runtime = write_runtime(tmp_path / "runtime", images=["registry.example/eval:1"])
    code = "import sys; print('loaded 2 layers'); sys.stderr.write('docker: Error response from daemon'); sys.exit(3)"
    command = EvaluationCommand(argv=python(code), image="registry.example/eval:1", timeout_s=30)
    outcome = run_model_command(command, model_dir, runtime=runtime, host_commands=False)
    assert outcome.failure == "the command exited with 3: loaded 2 layers"


def test_a_failure_reason_is_bounded(model_dir: Path) -> None:
    from gpucloud.registry.command_eval import MAX_FAILURE_CHARS

    long_name = run_command(["/no/such/" + "x" * 4000], model_dir, timeout_s=5)
    assert not long_name.ok and len(long_name.reason) <= MAX_FAILURE_CHARS
