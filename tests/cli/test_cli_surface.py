"""The CLI's surface: every option says what it does, and every command that prints data can
print it as JSON (`-o json`, `--output json`); the commands that run a process are the exceptions."""

from __future__ import annotations

import typing

import pytest
import typer

from gpucloud.cli.main import app

pytestmark = pytest.mark.unit

# Commands that run a component (or the whole stack), add a key to the data dir, or run a program
# in the CLI's place (`allocations ssh`), rather than print data.
RUNNERS = {
    "server",
    "worker",
    "api",
    "sim",
    "tracker",
    "up",
    "demo",
    "agent",
    "ledger",
    "fabric-managers",
    "codec-server",
    "codec-key-rotate",
    "issue-delegate",
    "allocations ssh",
}


def commands() -> dict[str, object]:
    found: dict[str, object] = {}

    def walk(command, path: list[str]) -> None:
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])
        else:
            found[" ".join(path)] = command

    walk(typer.main.get_command(app), [])
    return found


def test_every_option_has_help_and_every_data_command_speaks_json() -> None:
    found = commands()
    assert {"tenants create", "allocations cancel", "api-keys rotate", "operations show"} <= set(found)
    undocumented = [
        f"{name} --{param.name}"
        for name, command in found.items()
        for param in command.params
        if getattr(param, "param_type_name", "") == "option" and param.name != "help" and not param.help
    ]
    assert undocumented == []
    without_json = [name for name, command in found.items() if name not in RUNNERS and not _speaks_json(command)]
    assert without_json == []


def _speaks_json(command) -> bool:
    """`-o json` and `--output json` both work (before: `weights versions`, `keys` and `sanity`
    took `--output` only, so `-o json` was a usage error)."""
    [output] = [p for p in command.params if p.name == "output"] or [None]
    if output is None or not {"-o", "--output"} <= set(output.opts):
        return False
    return "json" in typing.get_args(output.type_descriptor.annotation)  # a choice, checked at parse


def test_the_invoices_listing_speaks_json_too() -> None:
    group = typer.main.get_command(app).commands["invoices"]
    assert _speaks_json(group)  # a group that lists when run alone
