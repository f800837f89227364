"""`gpucloud tenants | allocations | api-keys | operations`: the API's resources for operators
and tenants, as tables (or `--output json`), through the typed SDK (`gpucloud.client.api`).

Who calls: a tenant's key (`--api-key`, `GPUCLOUD_API_KEY`), else for operator commands
`GPUCLOUD_API__OPERATOR_TOKEN`, else the token of the CLI's context (`cli/contexts.py`). Creates
send an Idempotency-Key, so a command run again after a lost answer does not create twice;
`--wait` follows the operation to its end, bounded by `--timeout`. Exit codes are the CLI's (`cli/common.py`).
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from pydantic import BaseModel
from rich.table import Table

from gpucloud.cli.allocation_ssh import node_table
from gpucloud.cli.common import (
    ApiKey,
    ApiUrl,
    Output,
    WideOutput,
    api_client,
    console,
    err,
    id_column,
    parse_duration,
    print_table,
    reported_errors,
)
from gpucloud.cli.workload_options import workload_from_options

Wait = Annotated[bool, typer.Option("--wait/--no-wait", help="follow the operation until it ends")]
Timeout = Annotated[float, typer.Option(help="with --wait: give up after this many seconds (exit 5)")]


def _when(value: Any) -> str:
    return "" if value is None else str(value)[:19].replace("T", " ")


def emit(output: str, rows: Iterable[BaseModel] | BaseModel, table: Table | None = None) -> None:
    """Print `rows` as JSON (one object, or a list) or as `table` (already filled; `wide` too)."""
    if output == "json":
        data = (
            rows.model_dump(mode="json") if isinstance(rows, BaseModel) else [r.model_dump(mode="json") for r in rows]
        )
        print(json.dumps(data, indent=2))
    elif table is not None:
        print_table(table)


# The columns that hold ids, printed whole at any terminal width (`common.id_column`).
_ID_HEADERS = {"id", "tenant", "node", "resource", "workflow", "replaced by"}


def _table(title: str, *columns: str) -> Table:
    return Table(*(id_column(c) if c in _ID_HEADERS else c for c in columns), title=title)


# ---------------------------------------------------------------- tenants (operator)

tenants_app = typer.Typer(no_args_is_help=True, help="Tenants (operator): list, show, onboard, offboard.")


def _tenant_table(tenants: list) -> Table:
    table = _table("tenants", "id", "name", "status", "vni", "storage prefix", "created", "why it failed")
    for t in tenants:
        table.add_row(
            t.id,
            t.name,
            t.status,
            str(t.vni or ""),
            t.storage_prefix or "",
            _when(t.created_at),
            t.failure_reason or "",
        )
    return table


@tenants_app.command("list")
def tenants_list(
    status: Annotated[str | None, typer.Option(help="only tenants in this status")] = None,
    output: Output = "table",
    api_url: ApiUrl = None,
) -> None:
    """Every tenant, oldest first."""
    with reported_errors(), api_client(api_url, operator=True) as api:
        tenants = list(api.tenants.list(status=status))
    emit(output, tenants, _tenant_table(tenants))


@tenants_app.command("show")
def tenants_show(tenant_id: str, output: Output = "table", api_url: ApiUrl = None) -> None:
    """One tenant and its quotas (GPUs used of each type in each region)."""
    with reported_errors(), api_client(api_url, operator=True) as api:
        tenant, quotas = api.tenants.get(tenant_id), api.tenants.quotas(tenant_id)
    if output == "json":
        print(
            json.dumps({"tenant": tenant.model_dump(mode="json"), "quotas": quotas.model_dump(mode="json")}, indent=2)
        )
        return
    print_table(_tenant_table([tenant]))
    table = _table("quotas (granted; nothing else may be allocated)", "GPU type", "region", "max GPUs")
    for q in quotas.quotas:
        table.add_row(q.gpu_type, q.region, str(q.max_gpus))
    print_table(table)
    usage = _table("GPUs in use", "GPU type", "region", "GPUs", "of")
    for u in quotas.usage:
        usage.add_row(u.gpu_type, u.region, str(u.usage_gpus), str(u.max_gpus) if u.quota else "none granted")
    print_table(usage)


@tenants_app.command("create")
def tenants_create(
    name: str,
    quota: Annotated[
        list[str] | None,
        typer.Option(
            help="GPU_TYPE:REGION=GPUS (repeatable; `*` for any type or region): what it may hold; none given, it "
            "may allocate nothing until `gpucloud tenants quota` grants some"
        ),
    ] = None,
    wait: Wait = True,
    timeout: Timeout = 600.0,
    output: Output = "table",
    api_url: ApiUrl = None,
) -> None:
    """Onboard a tenant: its network, storage and first API key (shown once, here). The key is
    printed as soon as the API answers, before the wait (with `-o json`: in the one document at
    the end, or, if the wait is cut short, the API's answer before the error), so a timeout, a
    Ctrl-C or a stuck onboarding never loses it."""
    quotas = [_quota(q) for q in quota or []]
    with reported_errors(), api_client(api_url, operator=True) as api:
        accepted = api.tenants.create(name, quotas=quotas or None, idempotency_key=str(uuid.uuid4()))
        operation = accepted.operation
        if output != "json":
            console.print(f"tenant {accepted.id}: first API key (shown once): [bold]{accepted.api_key.key}[/]")
        tenant: BaseModel = accepted
        if wait:
            try:
                with console.status(f"onboarding {name} (network, storage, key)"):
                    operation = api.operations.wait(operation.id, timeout_s=timeout)
            except BaseException:
                if output == "json":
                    print(json.dumps(accepted.model_dump(mode="json"), indent=2))
                raise
            tenant = api.tenants.get(accepted.id)
    if output == "json":
        body = {**accepted.model_dump(mode="json"), **tenant.model_dump(mode="json")}
        print(json.dumps(body | {"operation": operation.model_dump(mode="json")}, indent=2))
    else:
        print_table(_tenant_table([tenant]))
        console.print(f"operation {operation.id}: {operation.status} {operation.error or ''}")
        if not quotas:
            err.print(
                f"[yellow]note:[/] no quota granted: {accepted.id} may allocate nothing until "
                f"`gpucloud tenants quota {accepted.id} H100:us-east-1=64` (say which type, region and GPUs)"
            )
    _fail_on(operation)


def _quota(text: str) -> dict[str, Any]:
    where, _, gpus = text.partition("=")
    gpu_type, _, region = where.partition(":")
    if not (gpu_type and region and gpus.isdigit()):
        raise typer.BadParameter(f"{text!r} is not GPU_TYPE:REGION=GPUS (say H100:us-east-1=64)", param_hint="--quota")
    return {"gpu_type": gpu_type, "region": region, "max_gpus": int(gpus)}


@tenants_app.command("offboard")
def tenants_offboard(
    tenant_id: str, wait: Wait = True, timeout: Timeout = 600.0, output: Output = "table", api_url: ApiUrl = None
) -> None:
    """Offboard a tenant: its keys revoked, its allocations released, its network and storage removed."""
    with reported_errors(), api_client(api_url, operator=True) as api:
        done = api.tenants.offboard(tenant_id)
        operation = api.operations.wait(done.operation.id, timeout_s=timeout) if wait else done.operation
        tenant = api.tenants.get(tenant_id)
    emit(output, type(done)(tenant=tenant, operation=operation), _tenant_table([tenant]))
    if output != "json":
        console.print(f"operation {operation.id}: {operation.status} {operation.error or ''}")
    _fail_on(operation)


def _fail_on(operation: Any) -> None:
    if operation.status == "failed":
        err.print(f"[red]operation {operation.id} failed:[/] {operation.error}")
        raise typer.Exit(1)


# ---------------------------------------------------------------- allocations

allocations_app = typer.Typer(no_args_is_help=True, help="Allocations: list, show, create, cancel, ssh.")


def _allocation_table(allocations: list, *, wide: bool = False) -> Table:
    """The allocations in 80 columns, ids whole; `wide` adds the tenant and fabric domain."""
    if wide:
        table = _table(
            "allocations", "id", "tenant", "status", "GPU type", "region", "nodes", "fabric domain", "created"
        )
    else:
        table = _table("allocations", "id", "status", "nodes", "region", "created")
    for a in allocations:
        status = a.status + (f" ({a.failure_reason})" if a.failure_reason else "")
        nodes = str(len(a.node_ids) or a.node_count or "")
        if wide:
            cells = [a.tenant_id, status, a.gpu_type, a.region, nodes, a.fabric_domain or ""]
        else:
            cells = [status, f"{nodes} {a.gpu_type}", a.region]
        table.add_row(a.id, *cells, _when(a.created_at))
    return table


@allocations_app.command("list")
def allocations_list(
    status: Annotated[str | None, typer.Option(help="only allocations in this status")] = None,
    tenant: Annotated[str | None, typer.Option(help="operator: one tenant's")] = None,
    output: WideOutput = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """The caller's allocations (the operator: everyone's), oldest first."""
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        allocations = list(api.allocations.list(status=status, tenant_id=tenant))
    emit(output, allocations, _allocation_table(allocations, wide=output == "wide"))


@allocations_app.command("show")
def allocations_show(
    allocation_id: str, output: WideOutput = "table", api_url: ApiUrl = None, api_key: ApiKey = None
) -> None:
    """One allocation, its nodes (with the ssh command that reaches each) and its events."""
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        allocation = api.allocations.get(allocation_id)
        events = list(api.allocations.events(allocation_id))
        nodes = api.allocations.nodes(allocation_id).items
    if output == "json":
        body = {
            "allocation": allocation.model_dump(mode="json"),
            "nodes": [n.model_dump(mode="json") for n in nodes],
            "events": [e.model_dump(mode="json") for e in events],
        }
        print(json.dumps(body, indent=2))
        return
    print_table(_allocation_table([allocation], wide=output == "wide"))
    if nodes:
        print_table(node_table(nodes))
    else:
        console.print("nodes: none yet")
    table = _table("events", "at", "kind", "node", "actor", "reason")
    for e in events:
        table.add_row(_when(e.at), e.kind, e.node_id or "", e.actor, e.reason or "")
    print_table(table)


@allocations_app.command("logs")
def allocations_logs(
    allocation_id: str,
    node: Annotated[str | None, typer.Option(help="which node's workload (default: the allocation's first)")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing until the workload exits")] = False,
    tail: Annotated[int | None, typer.Option(min=0, help="only the last N lines")] = None,
    output: Annotated[
        Literal["text", "json"],
        typer.Option("--output", "-o", help="text, or json: one {node_id, text} object per line as it comes"),
    ] = "text",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """What the workload on a node of the allocation printed (stdout and stderr), as it wrote it."""
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        if node is None:
            node_ids = api.allocations.get(allocation_id).node_ids
            if not node_ids:
                err.print(f"allocation {allocation_id} has no nodes (yet): nothing ran")
                raise typer.Exit(1)
            node = node_ids[0]
            if len(node_ids) > 1:
                err.print(f"[dim]node {node} (of {len(node_ids)}; --node picks another)[/]")
        terminal = sys.stdout.isatty()
        for text in api.allocations.logs(allocation_id, node, tail=tail, follow=follow):
            if output == "json":
                sys.stdout.write(json.dumps({"node_id": node, "text": text}) + "\n")
            else:
                sys.stdout.write(shown_on_terminal(text) if terminal else text)
            sys.stdout.flush()


_CONTROLS = {c: f"^{chr(c + 64)}" for c in range(32) if chr(c) not in "\n\t"} | {127: "^?"}


def shown_on_terminal(text: str) -> str:
    """The workload's text with its control characters shown, not obeyed (`^[` for ESC): what a
    program on the node printed must not move the reader's cursor, retitle its window or worse."""
    return text.translate(_CONTROLS)


@allocations_app.command("create")
def allocations_create(
    gpu_type: Annotated[str, typer.Option(help="H100, GB200, ...")],
    region: Annotated[str, typer.Option(help="the region to allocate in")],
    nodes: Annotated[int | None, typer.Option(help="whole nodes")] = None,
    nvl72_trays: Annotated[int | None, typer.Option(help="GB200: trays of one NVL72 rack instead of nodes")] = None,
    command: Annotated[
        str | None, typer.Option(help="the workload each node runs, as a shell would split it: 'python train.py'")
    ] = None,
    image: Annotated[str | None, typer.Option(help="a container image to run the workload in")] = None,
    env: Annotated[list[str] | None, typer.Option(help="NAME=VALUE in the workload's environment (repeatable)")] = None,
    ssh_key: Annotated[
        list[Path] | None, typer.Option(help="a public key file let in to the nodes (repeatable)")
    ] = None,
    queue: Annotated[
        bool, typer.Option("--queue", help="no room now: wait in the pool's queue instead of failing")
    ] = False,
    max_wait: Annotated[
        str | None, typer.Option(help="with --queue: give up if not placed within this long (30m, 2h, 1d)")
    ] = None,
    expected_duration: Annotated[
        str | None, typer.Option(help="how long it will run (2h): lets it backfill, and gives estimates")
    ] = None,
    tier: Annotated[
        Literal["on_demand", "preemptible"],
        typer.Option(help="preemptible: cheaper, on capacity nobody asked for, taken back with notice"),
    ] = "on_demand",
    wait: Wait = True,
    timeout: Timeout = 1800.0,
    output: Output = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Allocate nodes (or NVL72 trays), each running the workload the options name; with --wait,
    until it is ready (or failed). With --queue, a full pool queues it (see `gpucloud queue`)."""
    workload = workload_from_options(command=command, image=image, env=env or [], ssh_keys=ssh_key or [])
    if max_wait is not None and not queue:
        raise typer.BadParameter("--max-wait goes with --queue", param_hint="--max-wait")
    max_wait_s = parse_duration(max_wait, option="--max-wait") if max_wait is not None else None
    duration_s = parse_duration(expected_duration, option="--expected-duration") if expected_duration else None
    with reported_errors(), api_client(api_url, api_key) as api:
        accepted = api.allocations.create(
            gpu_type,
            region,
            nodes,
            nvl72_trays=nvl72_trays,
            workload=workload,
            idempotency_key=str(uuid.uuid4()),
            queue=queue,
            max_wait_s=max_wait_s,
            expected_duration_s=duration_s,
            tier=tier,
        )
        allocation = accepted.allocation
        if allocation.status == "queued":
            start = allocation.estimated_start_at
            expected = f", expected to start {_when(start)}" if start else ""
            err.print(f"allocation {allocation.id}: queued at position {allocation.queue_position}{expected}")
        if wait:
            with console.status(f"allocation {allocation.id}: {allocation.status}"):
                allocation = api.allocations.wait(allocation.id, {"ready", "failed", "released"}, timeout_s=timeout)
    emit(output, allocation, _allocation_table([allocation]))
    if allocation.status == "failed":
        err.print(f"[red]allocation {allocation.id} failed:[/] {allocation.failure_reason}")
        raise typer.Exit(1)


@allocations_app.command("cancel")
def allocations_cancel(
    allocation_id: str,
    wait: Wait = False,
    timeout: Timeout = 1800.0,
    output: Output = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Cancel (intent: the allocation shows `cancelling`, then `released` once its nodes are wiped)."""
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        allocation = api.allocations.cancel(allocation_id).allocation
        if wait:
            with console.status(f"allocation {allocation_id}: releasing"):
                allocation = api.allocations.wait(allocation_id, {"released", "failed"}, timeout_s=timeout)
    emit(output, allocation, _allocation_table([allocation]))


def queue_list(
    gpu_type: Annotated[str | None, typer.Option(help="only this GPU type's pools")] = None,
    region: Annotated[str | None, typer.Option(help="only this region's pools")] = None,
    output: WideOutput = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """The pools' queues: each queued allocation's position (1 is placed first) and estimated start
    (the operator sees every tenant's; a tenant its own)."""
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        entries = api.allocations.queue(gpu_type=gpu_type, region=region).items
    table = _table("queue", "pool", "pos", "allocation", "tenant", "nodes", "queued", "estimated start", "max wait")
    for e in entries:
        table.add_row(
            f"{e.gpu_type} {e.region}",
            str(e.position or ""),
            e.allocation_id,
            e.tenant_id,
            str(e.node_count),
            _when(e.queued_at),
            _when(e.estimated_start_at) or "unknown",
            f"{e.max_wait_s} s" if e.max_wait_s is not None else "none",
        )
    if not entries and output != "json":
        console.print("no queued allocations")
        return
    emit(output, entries, table)


# ---------------------------------------------------------------- API keys

api_keys_app = typer.Typer(no_args_is_help=True, help="API keys: the caller's own, or (operator) a tenant's.")
TenantOption = Annotated[str | None, typer.Option("--tenant", help="operator: this tenant's keys")]


def _key_table(keys: list) -> Table:
    table = _table("API keys", "id", "tenant", "created", "expires", "revoked", "replaced by")
    for k in keys:
        table.add_row(
            k.id, k.tenant_id, _when(k.created_at), _when(k.expires_at), _when(k.revoked_at), k.replaced_by or ""
        )
    return table


@api_keys_app.command("list")
def keys_list(tenant: TenantOption = None, output: Output = "table", api_url: ApiUrl = None, api_key: ApiKey = None):
    """The keys (never their secrets)."""
    with reported_errors(), api_client(api_url, api_key, operator=tenant is not None) as api:
        keys = api.api_keys.list(tenant_id=tenant).items
    emit(output, keys, _key_table(keys))


def _created(output: str, created: Any) -> None:
    if output == "json":
        emit(output, created)
        return
    console.print(f"key {created.id} for {created.tenant_id} (shown once): [bold]{created.key}[/]")
    if created.replaces:
        console.print(f"replaces {created.replaces}, which stops working at {_when(created.replaced_key_expires_at)}")


@api_keys_app.command("create")
def keys_create(tenant: TenantOption = None, output: Output = "table", api_url: ApiUrl = None, api_key: ApiKey = None):
    """A new key (its secret is shown once, here)."""
    with reported_errors(), api_client(api_url, api_key, operator=tenant is not None) as api:
        created = api.api_keys.create(tenant_id=tenant, idempotency_key=str(uuid.uuid4()))
    _created(output, created)


@api_keys_app.command("rotate")
def keys_rotate(
    key_id: str,
    grace: Annotated[
        int | None,
        typer.Option(
            metavar="SECONDS",
            min=0,
            show_default=False,
            help="seconds the old key keeps working (required; 0: it stops at once)",
        ),
    ] = None,
    tenant: TenantOption = None,
    output: Output = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Replace a key; the old one keeps working for --grace seconds."""
    # No default: a silent 0 cut off every process still holding the old key, and a silent grace
    # would leave a leaked key alive. The caller says which it means.
    if grace is None:
        raise typer.BadParameter(
            "pass --grace SECONDS: how long the old key keeps working (0: it stops at once, "
            "which cuts off whatever still uses it)",
            param_hint="--grace",
        )
    with reported_errors(), api_client(api_url, api_key, operator=tenant is not None) as api:
        created = api.api_keys.rotate(key_id, grace_period_s=grace, tenant_id=tenant)
    _created(output, created)


@api_keys_app.command("revoke")
def keys_revoke(
    key_id: str, tenant: TenantOption = None, output: Output = "table", api_url: ApiUrl = None, api_key: ApiKey = None
) -> None:
    """Revoke a key at once."""
    with reported_errors(), api_client(api_url, api_key, operator=tenant is not None) as api:
        revoked = api.api_keys.revoke(key_id, tenant_id=tenant)
    emit(output, revoked, _key_table([revoked]))


# ---------------------------------------------------------------- operations

operations_app = typer.Typer(no_args_is_help=True, help="Operations: the status of a long-running change.")


@operations_app.command("show")
def operations_show(
    operation_id: str,
    wait: Wait = False,
    timeout: Timeout = 600.0,
    output: Output = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """One operation; with --wait, once it has ended. Exits 1 when it failed."""
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        op = api.operations.wait(operation_id, timeout_s=timeout) if wait else api.operations.get(operation_id)
    table = _table("operation", "id", "kind", "resource", "actor", "status", "error", "workflow", "updated")
    table.add_row(
        op.id, op.kind, op.resource_id, op.actor, op.status, op.error or "", op.workflow_id or "", _when(op.updated_at)
    )
    emit(output, op, table)
    _fail_on(op)
