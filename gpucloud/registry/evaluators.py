"""The platform's evaluators on a version directory: the weight-sanity evaluator and the model's
own evaluation command, one outcome each, never an exception for what the weights or the
command did.

The same code runs where the platform evaluates: in the evaluation worker on a version it pulled
and verified itself (`activities.evaluation`), and on a rollout's canary nodes against the version
they just activated (`agent.weights_api`, `POST /weights/evaluate`).

A model's command runs in a container when it names an image: `<runtime> run --rm` with no
network and the version mounted read-only at `/model`, under the command's time limit (past it
the container is removed by name). Without an image it runs in the host's environment, and only
where the caller allows that (`host_commands`): on the evaluation worker that is the operator's
choice, as the command is the tenant's code; on the tenant's own node it is always allowed. A
simulated node runs no command at all (`simulated_command`).
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpucloud import children
from gpucloud.models.registry_names import EvaluatorName
from gpucloud.models.registry_tables import EvaluationCommand
from gpucloud.registry.command_eval import run_command

CONTAINER_MODEL_DIR = "/model"


@dataclass(frozen=True)
class EvaluatorOutcome:
    """One evaluator's results, or why it produced none; `details` names what is behind them."""

    evaluator: str
    results: dict[str, float]
    failure: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


def find_runtime(name: str | None) -> str | None:
    """The container runtime's executable: `name` (a command or a path), else podman, else docker."""
    for candidate in [name] if name else ["podman", "docker"]:
        if candidate and (found := shutil.which(candidate)):
            return found
    return None


def sanity(directory: Path, parent: Path | None) -> EvaluatorOutcome:
    """The weight-sanity evaluator against the parent's directory (None: no comparison)."""
    from gpucloud.registry.sanity import SanityError, evaluate  # numpy loads only when one runs

    try:
        report = evaluate(directory, parent)
    except (SanityError, OSError) as exc:
        return EvaluatorOutcome(EvaluatorName.SANITY, {}, failure=f"the weights are not readable: {exc}")
    return EvaluatorOutcome(EvaluatorName.SANITY, report.metrics(), details=report.details())


def container_argv(runtime: str, command: EvaluationCommand, directory: Path, name: str) -> list[str]:
    """`<runtime> run` of the command: no network, the version read-only at /model, its env.

    The tenant's text never stands where the runtime reads an option: each env pair is the value
    of its own `--env` (names are `[A-Za-z_][A-Za-z0-9_]*`, so none reads as a flag), and `--`
    ends the options before the image. docker and podman parse `run` with cobra, which stops at
    `--` and at the first argument that is not an option (the image), so the command's argv is
    the container's whatever it holds; the image grammar (no leading '-') is the second defence
    should a runtime not take `--`."""
    argv = [runtime, "run", "--rm", "--name", name, "--network", "none"]
    argv += ["--volume", f"{directory}:{CONTAINER_MODEL_DIR}:ro", "--workdir", CONTAINER_MODEL_DIR]
    for key, value in {**command.env, "GPUCLOUD_MODEL_DIR": CONTAINER_MODEL_DIR}.items():
        argv += ["--env", f"{key}={value}"]
    assert command.image is not None
    return [*argv, "--", command.image, *command.argv]


def never_run(command: EvaluationCommand, *, host_commands: bool) -> str | None:
    """Why a platform that allows host commands only per `host_commands` will never run
    `command`, and what it would run instead; None when it may run it. The API asks this when a
    command is registered, so the tenant learns it then and not from a failed evaluation later;
    the worker asks it again before it runs one (its settings may have changed since)."""
    if command.image is None and not host_commands:
        return (
            "the command names no image, and this platform runs tenants' commands only in containers "
            "(registry.evaluation_host_commands is off): register it with an image that holds the "
            'program, say {"argv": ["python", "eval.py"], "image": "registry.example.com/eval:1"}'
        )
    return None


def run_model_command(
    command: EvaluationCommand, directory: Path, *, runtime: str | None, host_commands: bool
) -> EvaluatorOutcome:
    """The model's evaluation command against `directory` (see the module doc)."""
    if (why := never_run(command, host_commands=host_commands)) is not None:
        return EvaluatorOutcome(EvaluatorName.COMMAND, {}, failure=f"the model's evaluation command: {why}")
    if command.image is None:
        outcome = run_command(command.argv, directory, timeout_s=command.timeout_s, env=command.env)
    else:
        executable = find_runtime(runtime)
        if executable is None:
            wanted = runtime or "podman or docker"
            return EvaluatorOutcome(
                EvaluatorName.COMMAND, {}, failure=f"no container runtime ({wanted}) to run image {command.image}"
            )
        name = f"gpucloud-eval-{uuid.uuid4().hex[:12]}"
        outcome = run_command(
            container_argv(executable, command, directory, name),
            directory,
            timeout_s=command.timeout_s,
            in_container=True,
        )
        if not outcome.ok:  # past the limit the client was killed, not the container
            subprocess.run(
                [executable, "rm", "--force", name],
                capture_output=True,
                timeout=60,
                check=False,
                **children.popen_kwargs(),
            )
    if not outcome.ok:
        return EvaluatorOutcome(EvaluatorName.COMMAND, {}, failure=outcome.reason)
    return EvaluatorOutcome(EvaluatorName.COMMAND, outcome.metrics)


# How a model's command is run against a version directory: `run_model_command` with the
# caller's runtime and host rule, or `simulated_command` on a simulated node.
CommandRunner = Callable[[EvaluationCommand, Path], EvaluatorOutcome]


def simulated_command(command: EvaluationCommand, directory: Path) -> EvaluatorOutcome:
    """A simulated node's answer for a model's command: it records what it would run and runs
    nothing, as the simulated fleet shares its host with the control plane, and tenant text
    never runs there. It reports no metrics: a gate on the command's metrics fails."""
    return EvaluatorOutcome(
        EvaluatorName.COMMAND,
        {},
        details={"simulated": True, "image": command.image, "argv": command.argv[:8]},
    )


def evaluate_directory(
    directory: Path,
    parent: Path | None,
    evaluators: list[EvaluatorName],
    command: EvaluationCommand | None,
    *,
    run_command: CommandRunner,
) -> dict[str, EvaluatorOutcome]:
    """Each named evaluator on the directory; `command` without a registered command fails it."""
    outcomes: dict[str, EvaluatorOutcome] = {}
    for evaluator in evaluators:
        if evaluator == EvaluatorName.SANITY:
            outcomes[evaluator] = sanity(directory, parent)
        elif command is None:
            outcomes[evaluator] = EvaluatorOutcome(
                evaluator, {}, failure="the model has no evaluation command registered"
            )
        else:
            outcomes[evaluator] = run_command(command, directory)
    return outcomes
