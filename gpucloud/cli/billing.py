"""`gpucloud invoices` and `gpucloud usage`: a tenant's invoices and metered usage as tables, read
through the control plane's API.

With a tenant's API key (`--api-key`, `GPUCLOUD_API_KEY` or the CLI's context) the tenant's own
invoices; with an operator's token (`GPUCLOUD_API__OPERATOR_TOKEN` or the context's) every
tenant's, or `--tenant`'s.
Amounts are integer micro-units in the API; shown here with six decimals.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Literal

import typer
from rich.table import Table

from gpucloud.cli.common import ApiKey, ApiUrl, Output, WideOutput, api_client, console, print_table, reported_errors

Justify = Literal["left", "right"]

invoices_app = typer.Typer(
    add_completion=False,
    invoke_without_command=True,
    help="Invoices as tables: list them, `show ID`, or the open period's `draft`.",
)

Tenant = Annotated[str | None, typer.Option("--tenant", help="operators: only this tenant")]


def money(micro: int) -> str:
    sign = "-" if micro < 0 else ""
    whole, fraction = divmod(abs(micro), 1_000_000)
    return f"{sign}{whole:,}.{fraction:06d}"


def gpu_hours(gpu_ms: int) -> str:
    return f"{gpu_ms / 3_600_000:,.4f}"


def invoice_list_table(invoices: list[dict], *, wide: bool = False) -> Table:
    """The invoices; `wide` adds each one's SHA-256, whole (`invoices show ID` prints it too)."""
    table = Table(title=f"invoices ({len(invoices)})")
    table.add_column("id", justify="right", no_wrap=True)
    table.add_column("period")
    table.add_column("tenant", no_wrap=True)  # ids whole (`common.id_column`)
    table.add_column("lines", justify="right")
    table.add_column("total", justify="right")
    if wide:
        table.add_column("sha256", no_wrap=True)
    for invoice in invoices:
        table.add_row(
            str(invoice["id"]),
            invoice["period_id"],
            invoice["tenant_id"],
            str(invoice["line_count"]),
            money(invoice["total_micro"]),
            *([invoice["sha256"]] if wide else []),
        )
    return table


def invoice_table(document: dict, *, status: str) -> Table:
    """One invoice document (`gpucloud.invoice/v2`, or a v1 one closed before): its lines and total.

    The usage period and discount columns appear only when some line has one worth showing (a
    late adjustment for an earlier period, a committed-use discount), so the table fits a terminal.
    """
    period = document["period"]["id"]
    lines = [_line_v2(line) for line in document["lines"]] if "quantity_unit" in document else document["lines"]
    late = any(line["usage_period"] != period for line in lines)
    discounted = any(line["discount_bp"] for line in lines)
    table = Table(title=f"invoice {period}, {document['tenant_id']} ({status})")
    columns: list[tuple[str, Justify]] = [
        ("kind", "left"),
        ("allocation", "left"),
        ("gpu", "left"),
        ("samples", "right"),
        ("GPU-hours", "right"),
        ("per GPU-h", "right"),
        ("amount", "right"),
    ]
    if "quantity_unit" in document:
        # v2: what was bought, by price class; no samples (the meters are in the reconciliation).
        columns[1], columns[3] = ("allocation / reservation", "left"), ("class", "left")
    if late:
        columns.insert(3, ("used in", "left"))
    if discounted:
        columns.insert(-1, ("discount", "right"))
    for column, justify in columns:
        table.add_column(column, justify=justify, overflow="fold", no_wrap=column == "allocation")
    for line in lines:
        cells = [
            line["kind"],
            line["allocation_id"],
            line["gpu_type"],
            str(line["count"]),
            gpu_hours(line["gpu_ms"]),
            money(line["price_per_hour_micro"]),
            money(line["amount_micro"]),
        ]
        if late:
            cells.insert(3, line["usage_period"])
        if discounted:
            cells.insert(-1, f"{line['discount_bp'] / 100:g}%")
        table.add_row(*cells)
    return table


def _line_v2(line: dict) -> dict:
    """A `gpucloud.invoice/v2` line in the columns the table prints (its class where v1 had samples)."""
    return {
        **line,
        "allocation_id": line["reservation_id"] or line["allocation_id"],
        "count": line["price_class"].replace("_", "-"),
        "gpu_ms": line["quantity"],
        "price_per_hour_micro": line["price"],
    }


def print_invoice(document: dict, *, status: str) -> None:
    print_table(invoice_table(document, status=status))
    console.print(f"total {money(document['total_micro'])}")


@invoices_app.callback()
def invoices(
    ctx: typer.Context,
    api_key: ApiKey = None,
    tenant: Tenant = None,
    period: Annotated[str | None, typer.Option(help="only this period (YYYY-MM)")] = None,
    output: WideOutput = "table",
) -> None:
    """List invoices of closed periods (`show ID` for one, `draft` for the current period's so far)."""
    if ctx.invoked_subcommand is not None:
        return
    with reported_errors(), api_client(api_key=api_key, operator=True) as api:
        listing = api.billing.invoices(tenant_id=tenant, period=period)
    rows = [i.model_dump(mode="json") for i in listing.items]
    if output == "json":
        print(json.dumps(rows, indent=2))
        return
    print_table(invoice_list_table(rows, wide=output == "wide"))


@invoices_app.command()
def show(invoice_id: int, api_key: ApiKey = None, output: Output = "table") -> None:
    """One invoice's lines and total, and the SHA-256 of its bytes (the same bytes every time)."""
    with reported_errors(), api_client(api_key=api_key, operator=True) as api:
        invoice = api.billing.invoice(invoice_id)
    if output == "json":
        print(json.dumps({"invoice": invoice.body, "sha256": invoice.etag}, indent=2))
        return
    print_invoice(invoice.body, status="final")
    console.print(f"sha256 {invoice.etag}")


@invoices_app.command()
def draft(
    api_key: ApiKey = None,
    tenant: Tenant = None,
    period: Annotated[str | None, typer.Option(help="an open period (default: the current one)")] = None,
    output: Output = "table",
) -> None:
    """What the open period's invoice holds so far."""
    with reported_errors(), api_client(api_key=api_key, operator=True) as api:
        invoice = api.billing.draft(tenant_id=tenant, period=period)
    if output == "json":
        print(json.dumps(invoice.body, indent=2))
        return
    print_invoice(invoice.body, status="draft")


def usage_table(report: dict) -> Table:
    """Metered GPU time and its amount by GPU type, reversals apart, and the net."""
    table = Table(title=f"usage of {report['tenant_id']}, {_usage_scope(report)}")
    columns: list[tuple[str, Justify]] = [
        ("GPU type", "left"),
        ("samples", "right"),
        ("GPU-hours", "right"),
        ("amount", "right"),
        ("reversed GPU-hours", "right"),
        ("reversed", "right"),
    ]
    for column, justify in columns:
        table.add_column(column, justify=justify)
    for row in report["by_gpu_type"]:
        table.add_row(
            row["gpu_type"],
            str(row["sample_count"]),
            gpu_hours(row["gpu_ms"]),
            money(row["amount_micro"]),
            gpu_hours(row["reversed_gpu_ms"]),
            money(row["reversed_amount_micro"]),
        )
    return table


def _usage_scope(report: dict) -> str:
    period = f"period {report['period']}" if report.get("period") else "all periods"
    return period + (f", allocation {report['allocation_id']}" if report.get("allocation_id") else "")


def usage(
    period: Annotated[
        str | None, typer.Option(help="a billing period, YYYY-MM (UTC); default: the current one")
    ] = None,
    allocation: Annotated[str | None, typer.Option(help="only this allocation's usage")] = None,
    tenant: Tenant = None,
    output: Output = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """The tenant's metered GPU usage and its amount this period (the nodes' meters, rated by the price
    book), by GPU type. The bill is the time allocations held their nodes: `gpucloud invoices draft`."""
    from gpucloud.ledger.periods import period_of

    period = period or period_of(time.time_ns() // 1_000_000)
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        report = api.billing.usage(allocation_id=allocation, period=period, tenant_id=tenant).model_dump(mode="json")
    if output == "json":
        print(json.dumps(report, indent=2))
        return
    print_table(usage_table(report))
    console.print(
        f"net {gpu_hours(report['net_gpu_ms'])} GPU-hours, {money(report['net_amount_micro'])} "
        f"({report['sample_count']} samples)"
    )
