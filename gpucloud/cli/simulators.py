"""`gpucloud sim` and `gpucloud fabric-managers`: the simulated fleet of host agents (with its
fault model and BMCs) and the simulated fabric managers, as processes of their own."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpucloud.cli.common import configure_logging
from gpucloud.config import get_settings

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


def sim(
    nodes: Annotated[int, typer.Option(help="number of simulated nodes")] = 16,
    register: Annotated[bool, typer.Option(help="enroll the nodes with the control plane's API")] = False,
    latency_scale: Annotated[float, typer.Option(help="action latency multiplier (0 = instant)")] = 1.0,
    provision_s: Annotated[
        float | None, typer.Option(help="every provision takes exactly this many seconds (to cancel one midway)")
    ] = None,
    diagnose_s: Annotated[
        float | None, typer.Option(help="every scheduled diagnose takes exactly this many seconds")
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
    ssh: Annotated[
        bool,
        typer.Option(
            help="give every node an SSH endpoint on a loopback port of its own, letting in its workload's keys "
            "as GPUCLOUD_AGENT__SSH_USER (a restricted shell: nothing runs)"
        ),
    ] = False,
) -> None:
    """Run a simulated fleet of N host agents on one port; like real agents, they act only on
    the control plane's signed calls."""
    from gpucloud.entrypoints import simulators

    configure_logging()
    simulators.serve_fleet(
        get_settings(),
        nodes=nodes,
        register=register,
        latency_scale=latency_scale,
        provision_s=provision_s,
        diagnose_s=diagnose_s,
        gpu_type=gpu_type,
        region=region,
        seed=seed,
        id_prefix=id_prefix,
        heartbeat_interval=heartbeat_interval,
        ledger_url=ledger_url,
        meter_interval=meter_interval,
        nvl72_racks=nvl72_racks,
        nvl72_trays_per_rack=nvl72_trays_per_rack,
        control_plane_key=control_plane_key,
        fault_model=fault_model_named(faults),
        fault_time_scale=time_scale,
        faults_paused=faults_paused,
        batch_reports=batch_reports,
        bmc=bmc,
        boot_s=boot_s,
        ssh=ssh,
    )


def fabric_managers(
    port: Annotated[int, typer.Option(help="port of the simulated managers")] = 8470,
    state: Annotated[Path | None, typer.Option(help="keep the managers' state in this JSON file")] = None,
    host: Annotated[str, typer.Option(help="the address to bind (off loopback: TLS, or GPUCLOUD_TLS__INSECURE)")] = (
        "127.0.0.1"
    ),
) -> None:
    """Run the simulated fabric managers (UFM pkeys, NMX-M NVLink partitions, SDN VPCs)."""
    from gpucloud.entrypoints import simulators

    configure_logging()
    simulators.serve_fabric_managers(get_settings(), host=host, port=port, state_path=state)
