"""`gpucloud config`: the contexts of the CLI's config file (which API, which token, which CA),
the current one, and what a command would use now (`view`). Token values are never printed: a
token is shown by where it is and its kind's prefix (`gpc_`, `gpo_`, `gpcop_`)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from gpucloud.cli import contexts
from gpucloud.cli.common import ExitCode, Output, console, err, root_context_option
from gpucloud.cli.contexts import ClientConfig, ConfigProblem, Context

config_app = typer.Typer(
    no_args_is_help=True,
    help="Which API the CLI calls and with which token: named contexts (as kubectl's), in "
    "$GPUCLOUD_CONFIG, else $XDG_CONFIG_HOME/gpucloud/config.yaml, else ~/.config/gpucloud/config.yaml.",
)
Name = Annotated[str, typer.Argument(help="the context's name (letters, digits, '.', '_', '-')")]


def _load() -> tuple[ClientConfig, Path]:
    path = contexts.config_path()
    try:
        return contexts.load(path), path
    except ConfigProblem as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(ExitCode.USAGE_OR_VERIFICATION) from None


def _known(config: ClientConfig, name: str, path: Path) -> Context:
    if name not in config.contexts:
        known = ", ".join(sorted(config.contexts)) or "none yet"
        raise typer.BadParameter(f"no context named {name!r} in {path} (it has: {known})", param_hint="NAME")
    return config.contexts[name]


def _checked(check: Any, value: Any, option: str) -> Any:
    try:
        return check(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None


def _token_from_stdin() -> str:
    token = typer.prompt("token", hide_input=True) if sys.stdin.isatty() else sys.stdin.read()
    token = token.strip()
    if not token or any(c.isspace() for c in token):
        raise typer.BadParameter("stdin holds no token (one line, no spaces)", param_hint="--token-stdin")
    return token


def _token_file(path: Path) -> Path:
    path = contexts.check_readable_file(path, what="the token file")
    if not path.read_text().strip():
        raise ValueError(f"the token file {path} is empty")
    mode = path.stat().st_mode
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        err.print(
            f"[yellow]warning:[/] {escape(str(path))} is readable by others (mode {oct(mode & 0o777)}): chmod 600 it"
        )
    return path


def describe_token(name: str, context: Context, path: Path) -> dict[str, Any]:
    """Where a context's token is and its prefix, or what is wrong with it; never its value."""
    where = "file" if context.token_file is not None else "config file" if context.token is not None else "none"
    row: dict[str, Any] = {"token": where, "token_file": str(context.token_file) if context.token_file else None}
    try:
        token = context.read_token(name, path)
    except ConfigProblem as exc:
        return row | {"token_prefix": None, "problem": str(exc)}
    return row | {"token_prefix": contexts.token_prefix(token) if token else None, "problem": None}


def context_row(name: str, context: Context, config: ClientConfig, path: Path) -> dict[str, Any]:
    return {
        "name": name,
        "current": config.current_context == name,
        "api_url": context.api_url,
        **describe_token(name, context, path),
        "ca_file": str(context.ca_file) if context.ca_file else None,
    }


def _token_cell(row: dict[str, Any]) -> str:
    if row["problem"]:
        return f"[red]cannot use: {escape(row['problem'])}[/]"
    shown = f"{row['token_prefix']}…" if row["token_prefix"] else "…"
    if row["token"] == "file":
        return f"{shown} from {escape(row['token_file'])}"
    if row["token"] == "config file":
        return f"{shown} written in the config file"
    return "none (GPUCLOUD_API_KEY or GPUCLOUD_API__OPERATOR_TOKEN gives it)"


def _print_rows(rows: list[dict[str, Any]], path: Path) -> None:
    table = Table("current", "name", "API URL", "token", "CA file", title=f"contexts in {path}")
    for row in rows:
        table.add_row(
            "*" if row["current"] else "", row["name"], row["api_url"], _token_cell(row), row["ca_file"] or ""
        )
    console.print(table)


@config_app.command("set-context")
def set_context(
    name: Name,
    api_url: Annotated[
        str | None, typer.Option("--api-url", help="the API's URL, http:// or https:// (a new context needs one)")
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option("--token-file", help="a file holding the token (read at each command; keep it 0600)"),
    ] = None,
    token_stdin: Annotated[
        bool,
        typer.Option("--token-stdin", help="read the token from stdin and keep it in the config file (0600) instead"),
    ] = False,
    ca_file: Annotated[
        Path | None, typer.Option("--ca-file", help="the CA that signed the API's certificate (PEM), if private")
    ] = None,
    use: Annotated[bool, typer.Option("--use", help="make it the current context")] = False,
    output: Output = "table",
) -> None:
    """Create a context, or change the parts of one given here (the rest stay)."""
    _checked(contexts.check_name, name, "NAME")
    if token_file is not None and token_stdin:
        raise typer.BadParameter("give --token-file or --token-stdin, not both", param_hint="--token-file")
    config, path = _load()
    existing = config.contexts.get(name)
    if api_url is None and existing is None:
        raise typer.BadParameter(f"the new context {name!r} needs --api-url", param_hint="--api-url")
    url = _checked(contexts.check_api_url, api_url, "--api-url") if api_url is not None else None
    update: dict[str, Any] = {}
    if url is not None:
        update["api_url"] = url
    if token_file is not None:
        update |= {"token_file": _checked(_token_file, token_file, "--token-file"), "token": None}
    if token_stdin:
        update |= {"token": _token_from_stdin(), "token_file": None}
    if ca_file is not None:
        update["ca_file"] = _checked(contexts.check_ca_file, ca_file, "--ca-file")
    context = Context.model_validate((existing.model_dump() if existing else {}) | update)
    config.contexts[name] = context
    if use:
        config.current_context = name
    contexts.save(config, path)
    if contexts.sends_in_clear(context.api_url):
        err.print(
            f"[yellow]warning:[/] {context.api_url} is plain http off this machine: the token crosses the network "
            "unencrypted (use https unless the network is trusted)"
        )
    row = context_row(name, context, config, path)
    if output == "json":
        print(json.dumps(row, indent=2))
        return
    ca = f", CA {escape(row['ca_file'])}" if row["ca_file"] else ""
    console.print(f"context '{name}' set in {escape(str(path))}: {context.api_url}, token {_token_cell(row)}{ca}")
    if config.current_context == name:
        console.print(f"current context: {name}")
    else:
        console.print(f"not the current context: `gpucloud config use-context {name}` (or --use) makes it so")


@config_app.command("use-context")
def use_context(name: Name, output: Output = "table") -> None:
    """Make a context the current one: commands use it unless --context or GPUCLOUD_CONTEXT says otherwise."""
    config, path = _load()
    context = _known(config, name, path)
    config.current_context = name
    contexts.save(config, path)
    if output == "json":
        print(json.dumps(context_row(name, context, config, path), indent=2))
        return
    console.print(f"current context: {name} ({context.api_url})")


@config_app.command("get-contexts")
def get_contexts(output: Output = "table") -> None:
    """List the contexts: each API, where its token is (and its prefix only) and its CA; * marks the current."""
    config, path = _load()
    rows = [context_row(name, context, config, path) for name, context in sorted(config.contexts.items())]
    if output == "json":
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        console.print(f"no contexts in {escape(str(path))}: {escape(contexts.SET_CONTEXT_HINT)}")
        return
    _print_rows(rows, path)


@config_app.command("current-context")
def current_context(output: Output = "table") -> None:
    """The context commands use now (--context, GPUCLOUD_CONTEXT, else the current one): its name
    on the first line, then its API, token and CA; exit 1 when there is none."""
    try:
        chosen = contexts.choose_context(root_context_option())
    except ConfigProblem as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(ExitCode.USAGE_OR_VERIFICATION) from None
    if chosen.name is None or chosen.context is None:
        if output == "json":
            print(json.dumps({"name": None, "source": chosen.why}))
        err.print(f"no current context: {escape(chosen.why)}; `gpucloud config use-context NAME` sets one")
        raise typer.Exit(ExitCode.ERROR)
    row = context_row(chosen.name, chosen.context, contexts.load(chosen.file), chosen.file) | {"source": chosen.why}
    if output == "json":
        print(json.dumps(row, indent=2))
        return
    console.print(chosen.name, highlight=False)
    console.print(f"  chosen by  {escape(chosen.why)}", highlight=False)
    console.print(f"  API        {row['api_url']}", highlight=False)
    console.print(f"  token      {_token_cell(row)}", highlight=False)
    if row["ca_file"]:
        console.print(f"  CA         {escape(row['ca_file'])}", highlight=False)
    overriding = [
        name for name in (contexts.URL_ENV, contexts.KEY_ENV, contexts.OPERATOR_TOKEN_ENV) if os.environ.get(name)
    ]
    if overriding:
        console.print(f"  ({', '.join(overriding)} set here: it wins over the context; `gpucloud config view`)")


@config_app.command("delete-context")
def delete_context(name: Name, output: Output = "table") -> None:
    """Remove a context (its token file stays where it is); if it was current, none is now."""
    config, path = _load()
    _known(config, name, path)
    del config.contexts[name]
    was_current = config.current_context == name
    if was_current:
        config.current_context = None
    contexts.save(config, path)
    if output == "json":
        print(json.dumps({"deleted": name, "current_context": config.current_context}))
        return
    console.print(f"context '{name}' deleted from {escape(str(path))}")
    if was_current:
        console.print("no current context now: `gpucloud config use-context NAME` picks one")


def _resolved(found: contexts.Source | None, problem: str | None) -> dict[str, Any] | None:
    if problem is not None:
        return {"source": None, "prefix": None, "problem": problem}
    if found is None:
        return None
    return {"source": found.source, "prefix": contexts.token_prefix(found.value), "problem": None}


def resolution() -> dict[str, Any]:
    """What an API command would use now, each part with where it came from (`contexts.resolve`)."""
    chosen = contexts.choose_context(root_context_option())
    url = contexts.resolve_url(None, chosen)
    view: dict[str, Any] = {
        "config_file": str(chosen.file),
        "config_file_source": contexts.config_source(),
        "context": chosen.name,
        "context_source": chosen.why,
        "api_url": url.value if url else None,
        "api_url_source": url.source if url else None,
        "ca_file": str(ca) if url and (ca := contexts.ca_file_for(chosen, url)) else None,
    }
    for key, operator in (("tenant_token", False), ("operator_token", True)):
        try:
            view[key] = _resolved(contexts.resolve_token(None, chosen, operator=operator), None)
        except ConfigProblem as exc:
            view[key] = _resolved(None, str(exc))
    return view


def _token_cells(token: dict[str, Any] | None) -> tuple[str, str]:
    if token is None:
        return "[red]none[/]", "`gpucloud config set-context NAME --token-file PATH`, or GPUCLOUD_API_KEY"
    if token["problem"]:
        return "[red]cannot use[/]", escape(token["problem"])
    return f"{token['prefix'] or ''}…", escape(token["source"])


@config_app.command("view")
def view(output: Output = "table") -> None:
    """What an API command would use now: context, API URL, CA and token, each with where it came from."""
    try:
        shown = resolution()
    except ConfigProblem as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(ExitCode.USAGE_OR_VERIFICATION) from None
    if output == "json":
        print(json.dumps(shown, indent=2))
        return
    table = Table("", "uses", "from", title="what `gpucloud` commands use now", show_header=False)
    table.add_row("config file", escape(shown["config_file"]), shown["config_file_source"])
    table.add_row("context", shown["context"] or "[dim]none[/]", escape(shown["context_source"]))
    table.add_row(
        "API URL",
        shown["api_url"] or "[red]none[/]",
        escape(shown["api_url_source"] or f"`{contexts.SET_CONTEXT_HINT}`, or GPUCLOUD_API_URL"),
    )
    if shown["ca_file"]:
        table.add_row("CA file", escape(shown["ca_file"]), f"context '{shown['context']}'")
    table.add_row("token (tenant commands)", *_token_cells(shown["tenant_token"]))
    table.add_row("token (operator commands)", *_token_cells(shown["operator_token"]))
    console.print(table)
