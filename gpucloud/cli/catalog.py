"""`gpucloud catalog | whoami | tenants quota`: what a tenant may ask for, who the credential in
use is, and the quotas an operator grants.

`catalog` and `whoami` take a tenant's key or an operator's token (`--api-key`, else the
environment or the context, as every API command). `tenants quota` (operator) changes a
tenant's quotas by merging the grants it is given into those it holds (`--replace`: exactly
these), since the API's `PUT .../quotas` replaces them all.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from gpucloud.cli.common import ApiKey, ApiUrl, Output, api_client, console, err, print_table, reported_errors
from gpucloud.cli.resources import emit

ANY = "*"


def money(micro: int | None) -> str:
    """Micro-units as currency (`2490000` -> `2.49`); empty when unknown."""
    return "" if micro is None else f"{micro / 1_000_000:,.2f}"


def catalog(
    gpu_type: Annotated[str | None, typer.Option(help="only this GPU type (any case)")] = None,
    region: Annotated[str | None, typer.Option(help="only this region")] = None,
    output: Output = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """What you may ask for: GPU types and regions on offer, nodes available now, GPUs per node
    and the price per GPU-hour (`allocations create --gpu-type T --region R --nodes N`)."""
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        offered = api.catalog(gpu_type=gpu_type, region=region)
    table = Table(
        "GPU type", "region", "available nodes", "nodes", "GPUs/node", "per GPU-hour", "per node-hour", title="catalog"
    )
    for item in offered.items:
        per_gpu = item.price_per_gpu_hour_micro
        if per_gpu is not None and item.discount_bp:
            per_gpu = per_gpu * (10_000 - item.discount_bp) // 10_000
        table.add_row(
            item.gpu_type,
            item.region,
            str(item.available_nodes),
            str(item.nodes),
            str(item.gpus_per_node),
            money(per_gpu) + (f" ({item.discount_bp / 100:g}% off)" if item.discount_bp else ""),
            money(None if per_gpu is None else per_gpu * item.gpus_per_node),
        )
    emit(output, offered, table)
    if output != "json":
        if not offered.items:
            err.print("the fleet offers nothing yet: no node is enrolled")
        if offered.prices_note:
            err.print(f"[yellow]note:[/] {offered.prices_note}")


def whoami(output: Output = "table", api_url: ApiUrl = None, api_key: ApiKey = None) -> None:
    """Who the credential in use is: a tenant (its key, quotas and usage this period) or an
    operator (its role)."""
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        me = api.whoami()
    if output == "json":
        emit(output, me)
        return
    if me.kind == "operator":
        console.print(f"operator {me.operator} (role {me.role}; scopes: {', '.join(me.scopes)})")
        return
    assert me.tenant is not None and me.api_key is not None and me.quotas is not None  # a tenant's answer has them
    console.print(f"tenant   {me.tenant.name} ({me.tenant.id}), {me.tenant.status}")
    expiry = f", expires {me.api_key.expires_at:%Y-%m-%d %H:%M} UTC" if me.api_key.expires_at else ""
    console.print(f"API key  {me.api_key.id} ({me.api_key.prefix}…){expiry}")
    print_table(_quota_table(me.quotas))
    if me.usage_this_period is not None:
        usage = me.usage_this_period
        hours = usage.net_gpu_ms / 3_600_000
        console.print(f"usage {usage.period}: {hours:,.2f} GPU-hours, {money(usage.net_amount_micro)} so far")
    elif me.usage_note:
        console.print(f"usage this period: unknown ({me.usage_note})")


def _quota_table(report: Any) -> Table:
    """Granted quotas with what is held against each (held nodes of a type and region count
    against the most specific grant, as admission counts them)."""
    table = Table("GPU type", "region", "granted GPUs", "held", title="quotas (granted; nothing else may be allocated)")
    held: dict[tuple[str, str], list[str]] = {}
    for u in report.usage:
        where = (u.quota.gpu_type, u.quota.region) if u.quota else (u.gpu_type, u.region)
        held.setdefault(where, []).append(f"{u.gpu_type}/{u.region}: {u.usage_nodes} nodes ({u.usage_gpus} GPUs)")
    for q in report.quotas:
        table.add_row(q.gpu_type, q.region, str(q.max_gpus), "; ".join(held.pop((q.gpu_type, q.region), [])) or "0")
    for (gpu_type, region), lines in held.items():
        table.add_row(gpu_type, region, "none granted", "; ".join(lines))
    return table


def _grant(text: str) -> tuple[tuple[str, str], int]:
    where, _, gpus = text.partition("=")
    gpu_type, _, region = where.partition(":")
    if not (gpu_type and region and gpus.isdigit()):
        raise typer.BadParameter(f"{text!r} is not GPU_TYPE:REGION=GPUS (say H100:us-east-1=64)", param_hint="GRANT")
    return _where(gpu_type, region), int(gpus)


def _where(gpu_type: str, region: str) -> tuple[str, str]:
    """A quota's key as the API spells it (GPU types in the catalogue's case), so a merge of
    `h100` and `H100` replaces, not duplicates."""
    from gpucloud.models.catalog import known_gpu_type

    return (gpu_type if gpu_type == ANY else known_gpu_type(gpu_type) or gpu_type), region


def tenants_quota(
    tenant_id: str,
    grants: Annotated[
        list[str] | None,
        typer.Argument(help="GPU_TYPE:REGION=GPUS to grant (`*` for any type or region; 0 to cap at none)"),
    ] = None,
    remove: Annotated[
        list[str] | None, typer.Option(help="GPU_TYPE:REGION to take away (repeatable): it may not allocate there")
    ] = None,
    replace: Annotated[bool, typer.Option("--replace", help="the quotas become exactly GRANTS")] = False,
    output: Output = "table",
    api_url: ApiUrl = None,
) -> None:
    """Show or change a tenant's GPU quotas (operator). A tenant may allocate only a GPU type and
    region a quota covers: `gpucloud tenants quota TENANT_ID H100:us-east-1=64`."""
    granted = dict(_grant(g) for g in grants or [])
    removed = []
    for text in remove or []:
        gpu_type, _, region = text.partition(":")
        if not (gpu_type and region):
            raise typer.BadParameter(f"{text!r} is not GPU_TYPE:REGION", param_hint="--remove")
        removed.append(_where(gpu_type, region))
    with reported_errors(), api_client(api_url, operator=True) as api:
        report = api.tenants.quotas(tenant_id)
        if granted or removed or replace:
            rows = {} if replace else {(q.gpu_type, q.region): q.max_gpus for q in report.quotas}
            rows.update(granted)
            for where in removed:
                if rows.pop(where, None) is None:
                    raise typer.BadParameter(f"{where[0]}:{where[1]} is not granted", param_hint="--remove")
            quotas = [{"gpu_type": t, "region": r, "max_gpus": n} for (t, r), n in sorted(rows.items())]
            report = api.tenants.set_quotas(tenant_id, quotas)
    if output == "json":
        print(json.dumps(report.model_dump(mode="json"), indent=2))
        return
    print_table(_quota_table(report))
    if not report.quotas:
        err.print(f"[yellow]note:[/] {tenant_id} holds no quota: it may allocate nothing")
