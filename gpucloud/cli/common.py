"""What every command group of the CLI shares: the consoles, the API options, the typed API
client, and the one place failures a person can act on become a clear line and an exit code."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from enum import IntEnum
from typing import TYPE_CHECKING, Annotated

import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn

from gpucloud.client.base import ApiError, ApiTimeout
from gpucloud.config import get_settings

if TYPE_CHECKING:  # the SDK imports every wire schema: only the commands that call the API pay for it
    from gpucloud.client.api import Gpucloud

console, err = Console(), Console(stderr=True)

ApiUrl = Annotated[str | None, typer.Option("--api-url", envvar="GPUCLOUD_API_URL", help="default: the configured API")]
ApiKey = Annotated[str | None, typer.Option("--api-key", envvar="GPUCLOUD_API_KEY", help="the tenant's API key")]


def api_client(api_url: str | None = None, api_key: str | None = None, *, operator: bool = False) -> Gpucloud:
    """The API as the caller sees it: the tenant's key, or with `operator` and no key the
    operator token (GPUCLOUD_API__OPERATOR_TOKEN or the data dir's)."""
    settings = get_settings()
    token = api_key or (settings.operator_token if operator else None)
    if not token:
        err.print("[red]error:[/] no API key: set GPUCLOUD_API_KEY or pass --api-key")
        raise typer.Exit(1)
    from gpucloud.client.api import Gpucloud

    return Gpucloud(api_url or settings.api_url, token, retry_for_s=3)


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
    status that says which (`ExitCode`)."""
    try:
        yield
    except ApiError as exc:
        err.print(f"[red]error ({exc.status}):[/] {exc.title}: {exc.detail}")
        raise typer.Exit(exit_code_for(exc.status)) from None
    except ApiTimeout as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(ExitCode.UNAVAILABLE) from None
    except httpx.TransportError as exc:
        err.print(f"[red]error:[/] cannot reach {what} ({exc}); is `gpucloud up` running?")
        raise typer.Exit(ExitCode.UNAVAILABLE) from None


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
