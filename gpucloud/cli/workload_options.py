"""What `gpucloud allocations create` runs on every node: the workload its `--command`, `--image`,
`--env` and `--ssh-key` options describe (`gpucloud.protocol.actions.Workload`). A mistake in them
is bad usage (exit 2) that names the option, found before anything is sent."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer
from pydantic import ValidationError

from gpucloud.protocol.actions import Workload

SSH_KEY_MAX_BYTES = 16 * 1024  # an authorized_keys line; a bigger file is not a public key


def parse_env(pairs: list[str]) -> dict[str, str]:
    """`K=V` options as a mapping (the value may hold `=`, and may be empty)."""
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise typer.BadParameter(f"{pair!r} is not NAME=VALUE (say --env EPOCHS=3)", param_hint="--env")
        env[name] = value
    return env


def read_ssh_key(path: Path) -> str:
    """The public key in `path` (an `.pub` file, one line); a private key is refused."""
    try:
        if path.stat().st_size > SSH_KEY_MAX_BYTES:
            raise typer.BadParameter(f"{path} is larger than a public key", param_hint="--ssh-key")
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc}", param_hint="--ssh-key") from exc
    if "PRIVATE KEY" in text:
        raise typer.BadParameter(f"{path} is a private key: give its .pub file", param_hint="--ssh-key")
    if not text or len(text.split()) < 2:
        raise typer.BadParameter(f"{path} holds no public key (`ssh-ed25519 AAAA...`)", param_hint="--ssh-key")
    return text


def workload_from_options(
    *, command: str | None, image: str | None, env: list[str], ssh_keys: list[Path]
) -> Workload | None:
    """The workload the options describe; None when they describe none."""
    if command is None and image is None and not env and not ssh_keys:
        return None
    try:
        argv = shlex.split(command) if command is not None else []
    except ValueError as exc:
        raise typer.BadParameter(f"{command!r}: {exc}", param_hint="--command") from exc
    try:
        return Workload(
            command=argv,
            image=image,
            env=parse_env(env),
            ssh_keys=[read_ssh_key(path) for path in ssh_keys],
        )
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'workload'}: {e['msg']}" for e in exc.errors()[:3])
        hint = "--command/--image" if any(not e["loc"] for e in exc.errors()) else "--command/--image/--env"
        raise typer.BadParameter(problems.replace("Value error, ", ""), param_hint=hint) from exc
