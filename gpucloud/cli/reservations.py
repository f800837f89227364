"""`gpucloud reservations`: book N nodes of a pool for a future window, list, show, cancel
(docs/scheduling.md)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from gpucloud.cli.common import ApiKey, ApiUrl, Output, WideOutput, api_client, parse_duration, reported_errors
from gpucloud.cli.resources import emit

if TYPE_CHECKING:
    from gpucloud.models.api_schemas import ReservationPublic

reservations_app = typer.Typer(
    no_args_is_help=True, help="Capacity reservations: N nodes booked for a future window (create, list, show, cancel)."
)


def _table(rows: list[ReservationPublic], *, wide: bool = False) -> Table:
    table = Table(title="reservations")
    columns = ["id", "status", "nodes", "start", "end", "allocation"] + (["tenant", "ready at"] if wide else [])
    for column in columns:
        table.add_column(column)
    for r in rows:
        cells = [
            r.id,
            r.status,
            f"{r.node_count} {r.gpu_type} {r.region}",
            r.start_at.isoformat(timespec="seconds"),
            r.end_at.isoformat(timespec="seconds"),
            r.allocation_id or "",
        ]
        if wide:
            cells += [r.tenant_id, r.ready_at.isoformat(timespec="seconds") if r.ready_at else ""]
        table.add_row(*cells)
    return table


def _start(text: str) -> datetime:
    """`in 2h` style offsets (`+2h`) or an ISO 8601 time with its zone."""
    if text.startswith("+"):
        return datetime.now(UTC) + timedelta(seconds=parse_duration(text[1:], option="--start"))
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise typer.BadParameter(
            f"{text!r} is neither +DURATION (+2h) nor an ISO 8601 time", param_hint="--start"
        ) from None
    if moment.tzinfo is None:
        raise typer.BadParameter("give the time zone (2027-01-01T08:00:00Z)", param_hint="--start")
    return moment


@reservations_app.command("create")
def reservations_create(
    gpu_type: Annotated[str, typer.Option(help="H100, GB200, ...")],
    region: Annotated[str, typer.Option(help="the region")],
    nodes: Annotated[int, typer.Option(min=1, help="whole nodes, in one fabric domain")],
    start: Annotated[str, typer.Option(help="when the window begins: +2h, or 2027-01-01T08:00:00Z")],
    duration: Annotated[str, typer.Option(help="how long it lasts: 8h, 3d")],
    output: Output = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Book the window: accepted only if the pool can honour it beside the other reservations; billed
    for the whole window at the reservation price, used or not."""
    begins = _start(start)
    ends = begins + timedelta(seconds=parse_duration(duration, option="--duration"))
    with reported_errors(), api_client(api_url, api_key) as api:
        made = api.reservations.create(gpu_type, region, nodes, begins, ends, idempotency_key=str(uuid.uuid4()))
    emit(output, made, _table([made]))


@reservations_app.command("list")
def reservations_list(
    status: Annotated[str | None, typer.Option(help="only reservations in this status")] = None,
    output: WideOutput = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """The caller's reservations (the operator: everyone's), by start."""
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        rows = sorted(api.reservations.list(status=status), key=lambda r: (r.start_at, r.id))
    emit(output, rows, _table(rows, wide=output == "wide"))


@reservations_app.command("show")
def reservations_show(
    reservation_id: str, output: WideOutput = "table", api_url: ApiUrl = None, api_key: ApiKey = None
) -> None:
    """One reservation: its window, status, and the allocation it runs as."""
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        row = api.reservations.get(reservation_id)
    emit(output, row, _table([row], wide=True))


@reservations_app.command("cancel")
def reservations_cancel(
    reservation_id: str, output: Output = "table", api_url: ApiUrl = None, api_key: ApiKey = None
) -> None:
    """Cancel before the window begins (nothing is billed)."""
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        row = api.reservations.cancel(reservation_id)
    emit(output, row, _table([row]))
