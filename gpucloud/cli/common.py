"""What every command group of the CLI shares: the consoles, the API options, the typed API
client, and the one place failures a person can act on become a clear line and an exit code."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from enum import IntEnum
from typing import TYPE_CHECKING, Annotated, Literal

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from gpucloud.cli import contexts
from gpucloud.client.base import ApiError, ApiTimeout
from gpucloud.config import get_settings

if TYPE_CHECKING:  # the SDK imports every wire schema: only the commands that call the API pay for it
    from gpucloud.client.api import Gpucloud

console, err = Console(), Console(stderr=True)

# No `envvar=` on these: `contexts.resolve` reads GPUCLOUD_API_URL and GPUCLOUD_API_KEY itself, so
# every command honours them (with an option or without) and can say which of the two it used.
ApiUrl = Annotated[
    str | None,
    typer.Option(
        "--api-url",
        help="the API's URL; else GPUCLOUD_API_URL, else the context's (`gpucloud config view` shows which)",
    ),
]
ApiKey = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        help="the token to call with (a tenant's API key, or an operator's token); else GPUCLOUD_API_KEY, else "
        "the context's (`gpucloud config view`)",
    ),
]


# One `--output` for every command that prints data: `-o json` prints one JSON document on stdout
# (progress and warnings go to stderr), a table otherwise; anything else is a usage error (exit 2).
Output = Annotated[Literal["table", "json"], typer.Option("--output", "-o", help="table, or json for scripts")]
# The same for the listings whose table has more columns than fit 80 characters: `wide` adds them.
WideOutput = Annotated[
    Literal["table", "wide", "json"],
    typer.Option("--output", "-o", help="table; wide: every column; json for scripts"),
]


def id_column(header: str) -> Column:
    """A column of ids, digests or key ids: never wrapped, folded or cut (`print_table` keeps it
    as wide as its longest value), since a person copies them whole."""
    return Column(header, no_wrap=True)


def print_table(table: Table, *, out: Console | None = None) -> None:
    """Print `table` with its `id_column`s whole and no word of another column cut.

    Where the table's natural width does not fit the terminal, every column gets its narrowest
    (an id column: its longest value; another: its longest word) and the room left is shared out
    in proportion to what each would take more; where even the narrowest do not fit, the lines
    run past the edge (the terminal wraps them) rather than cut an id, as `kubectl get -o wide`
    does. (rich alone shrinks the widest columns first, ids and words included.)"""
    out = out or console
    wide = out.options.update_width(10_000)

    def span(column: Column) -> tuple[int, int]:
        sizes = [Measurement.get(out, wide, cell) for cell in (column.header, *column.cells)]
        longest = max(size.maximum for size in sizes)
        return (longest if column.no_wrap else max(size.minimum for size in sizes)), longest

    spans = [span(column) for column in table.columns]
    natural = sum(most for _, most in spans)
    frame = Measurement.get(out, wide, table).maximum - natural  # borders and padding
    if natural + frame > out.width:
        narrowest = sum(least for least, _ in spans)
        spare = max(0, out.width - frame - narrowest)
        for column, (least, most) in zip(table.columns, spans, strict=True):
            column.width = least + spare * (most - least) // max(1, natural - narrowest)
        table.width = frame + sum(column.width or 0 for column in table.columns)
    out.print(table, crop=False)


class _Invocation:
    """What this run of `gpucloud` was told and chose: the root's `--context`, and the API and
    token `connect` resolved (the errors name where they came from). A process runs one command;
    the root callback starts each run afresh and clears it when the run ends, so a run of a
    command group alone (tests run many in one process) inherits nothing."""

    context_name: str | None = None
    connection: contexts.Connection | None = None


def begin_invocation(context_name: str | None) -> None:
    """A new run of `gpucloud`, told `--context context_name`; nothing resolved yet."""
    _Invocation.context_name, _Invocation.connection = context_name, None


def connect(
    api_url: str | None = None, api_key: str | None = None, *, operator: bool = False, key_option: str = "--api-key"
) -> contexts.Connection:
    """The API and token this command uses (`contexts.resolve`: options, environment, then the
    context), the context's CA trusted (and the deployment's, `GPUCLOUD_TLS__CA_FILE`); or exit 2
    saying how to configure them. `operator`: the command takes an operator token when no API key
    is given."""
    from gpucloud.web import tls

    try:
        connection = contexts.resolve(
            api_url=api_url, api_key=api_key, operator=operator, context=root_context_option(), key_option=key_option
        )
    except contexts.ConfigProblem as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(ExitCode.USAGE_OR_VERIFICATION) from None
    tls.trust(get_settings().tls.ca_file)  # as `bootstrap.trust_configured_ca`, without loading the bootstrap
    if connection.ca_file is not None:
        tls.trust(connection.ca_file)
    _Invocation.connection = connection
    return connection


def root_context_option() -> str | None:
    """The context `gpucloud --context NAME ...` names, if any."""
    return _Invocation.context_name


def api_client(api_url: str | None = None, api_key: str | None = None, *, operator: bool = False) -> Gpucloud:
    """The API as the caller sees it, through `connect`."""
    connection = connect(api_url, api_key, operator=operator)
    from gpucloud.client.api import Gpucloud

    return Gpucloud(connection.api_url, connection.token, retry_for_s=3)


class ExitCode(IntEnum):
    """What a `gpucloud` command's exit status means (the same for every command)."""

    OK = 0
    ERROR = 1  # the request was invalid or failed (the message says why)
    USAGE_OR_VERIFICATION = 2  # bad command-line usage; or bytes that failed verification (nothing written)
    NOT_FOUND = 3  # no such resource visible to the caller
    CONFLICT = 4  # refused by the resource's state: gates failed, a quota, a name taken, a revoked key
    UNAVAILABLE = 5  # the API or what it depends on did not answer in time: retry later


EXIT_CODES_HELP = (
    "Exit status: 0 ok; 1 error; 2 usage error or verification failed; 3 not found; 4 conflict "
    "(refused by state: gates, quota, exists); 5 unavailable or timed out (retry later)."
)


def exit_code_for(status: int) -> ExitCode:
    """The exit status for an API refusal: a request the API calls malformed or invalid (400, 422)
    is the caller's usage, as a bad flag is."""
    if status in (400, 422):
        return ExitCode.USAGE_OR_VERIFICATION
    if status == 404:
        return ExitCode.NOT_FOUND
    if status == 409:
        return ExitCode.CONFLICT
    if status in (429, 502, 503, 504):
        return ExitCode.UNAVAILABLE
    return ExitCode.ERROR


@contextmanager
def reported_errors(*, what: str = "the API") -> Iterator[None]:
    """Turn an API refusal, a timeout or an unreachable API into one line on stderr and the exit
    status that says which (`ExitCode`); a refused token or an unreachable URL is named with where
    it came from."""
    try:
        yield
    except ApiError as exc:
        err.print(f"[red]error ({exc.status}):[/] {exc.title}: {exc.detail}")
        connection = _connection()
        if connection is not None and exc.status in (401, 403):
            err.print(escape(refused_token_hint(connection, exc.status)))
        raise typer.Exit(exit_code_for(exc.status)) from None
    except ApiTimeout as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(ExitCode.UNAVAILABLE) from None
    except httpx.TransportError as exc:
        err.print(f"[red]error:[/] {escape(unreachable_message(what, exc, _connection()))}", highlight=False)
        raise typer.Exit(ExitCode.UNAVAILABLE) from None


def _connection() -> contexts.Connection | None:
    return _Invocation.connection


def refused_token_hint(connection: contexts.Connection, status: int) -> str:
    """What a 401 or 403 means for the token the command sent, named by where it came from."""
    where = f"{connection.api_url} (the URL from {connection.url_source})"
    if status == 403:
        return (
            f"the token from {connection.token_source} is known at {where} but may not do this: an operator "
            "command needs an operator's token with the scope named above; a tenant's key reaches only its own "
            "resources"
        )
    if (name := connection.token_from.context) is not None:
        fix = f"give it a valid token with `gpucloud config set-context {name} --token-file PATH`"
    else:
        fix = f"replace the token given in {connection.token_source}"
    return (
        f"the token from {connection.token_source} is unknown or revoked at {where}: check which token and API "
        f"the CLI uses with `gpucloud config view`, then {fix}"
    )


def unreachable_message(what: str, exc: httpx.TransportError, connection: contexts.Connection | None) -> str:
    if connection is None:
        return f"cannot reach {what} ({exc}); is `gpucloud up` running?"
    where = f"{what} at {connection.api_url} (the URL from {connection.url_source})"
    if "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return (
            f"cannot reach {where}: its certificate is not signed by a CA this CLI trusts ({exc}); give the "
            "context the deployment's CA (`gpucloud config set-context NAME --ca-file PATH`) or set "
            "GPUCLOUD_TLS__CA_FILE"
        )
    if connection.url.local:
        hint = "is `gpucloud up` running?"
    else:
        hint = "check the URL with `gpucloud config view`, and that the API is up"
    return f"cannot reach {where} ({exc}); {hint}"


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, *, option: str) -> int:
    """`90s`, `30m`, `24h`, `7d` (or plain seconds) as seconds; a usage error naming `option` else."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in _DURATION_UNITS else (text, "s")
    if not number.isdigit():
        raise typer.BadParameter(f"{text!r} is not a duration like 30m, 24h or 7d", param_hint=option)
    return int(number) * _DURATION_UNITS[unit]


def progress_bar(out: Console, *extra: ProgressColumn) -> Progress:
    """A bar of done out of total, with `extra` columns before the time elapsed."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        *extra,
        TimeElapsedColumn(),
        console=out,
    )


def configure_logging(service: str | None = None) -> None:
    """Logs as the settings say; with `service`, traces too (when an OTLP endpoint is set)."""
    from gpucloud.observability import logs, tracing

    settings = get_settings()
    telemetry = settings.telemetry
    logs.configure(level=os.environ.get("GPUCLOUD_LOG_LEVEL", telemetry.log_level), fmt=telemetry.log_format)
    if service is not None:
        tracing.configure(settings, service)
