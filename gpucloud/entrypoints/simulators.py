"""The simulators' processes: the simulated fleet of host agents (`gpucloud sim`, with its fault
model, its BMCs on the Redfish emulator and its metering) and the simulated fabric managers
(`gpucloud fabric-managers`), each serving what `gpucloud up` and the tests run against."""

from __future__ import annotations

from pathlib import Path

from gpucloud import bootstrap
from gpucloud.config import Settings
from gpucloud.db import Database
from gpucloud.sim.bmc import BmcEmulator, sim_bmc_password, write_sim_credential
from gpucloud.sim.fabric_managers import main as fabric_main
from gpucloud.sim.faults import FaultModel
from gpucloud.sim.fleet import FleetSpec, serve
from gpucloud.sim.metering import MeteringSpec
from gpucloud.sim.node_weights import WeightsSpec, control_plane_keyrings
from gpucloud.sim.nodes import Fleet
from gpucloud.sim.power import BmcLink
from gpucloud.web.service_tokens import Verifier, load_verifier


def serve_fleet(
    settings: Settings,
    *,
    nodes: int = 16,
    register: bool = False,
    latency_scale: float = 1.0,
    provision_s: float | None = None,
    diagnose_s: float | None = None,
    gpu_type: str = "H100",
    region: str = "us-east-1",
    seed: int = 0,
    id_prefix: str = "sim",
    heartbeat_interval: float = 10.0,
    ledger_url: str | None = None,
    meter_interval: float | None = None,
    nvl72_racks: int = 0,
    nvl72_trays_per_rack: int = 18,
    control_plane_key: Path | None = None,
    fault_model: FaultModel | None = None,
    fault_time_scale: float = 1.0,
    faults_paused: bool = False,
    batch_reports: bool = False,
    bmc: bool = False,
    boot_s: float = 3.0,
    ssh: bool = False,
) -> None:
    """Run a simulated fleet of `nodes` host agents on the settings' sim port until stopped (the
    options are `gpucloud sim`'s); like real agents, they act only on the control plane's signed
    calls. With a `fault_model` the fleet reports its faults to the API."""
    bootstrap.trust_configured_ca(settings)
    spec = FleetSpec(
        nodes=nodes,
        latency_scale=latency_scale,
        provision_s=provision_s,
        diagnose_s=diagnose_s,
        gpu_type=gpu_type,
        region=region,
        seed=seed,
        id_prefix=id_prefix,
        nvl72_racks=nvl72_racks,
        nvl72_trays_per_rack=nvl72_trays_per_rack,
        ssh=ssh,
        ssh_user=settings.agent.ssh_user,
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
        root=settings.data_dir / "sim-weights", keyring_for=control_plane_keyrings(Database(settings.database_url))
    )
    emulator, link = None, None
    if bmc:
        node_ids = list(Fleet(spec).nodes)
        notify = f"{settings.sim_url}/v1/bmc/notify?token={settings.operator_token}"
        emulator = BmcEmulator(
            settings.data_dir,
            settings.bmc.emulator_port,
            node_ids,
            notify_url=notify,
            power_delay_s=settings.bmc.emulator_power_delay_s,
        )
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
            fault_model=fault_model,
            fault_time_scale=fault_time_scale,
            # The fault model's reports and a failed switch's nodes' (`/v1/faults/switch_down`).
            fault_report_url=settings.api_url,
            faults_paused=faults_paused,
            heartbeat_interval_s=heartbeat_interval,
            metering=metering,
            weights=weights,
            batch_reports=batch_reports,
            bmc=link,
            request_body=settings.request_body,
            tls=settings.tls.server,
            insecure=settings.tls.insecure,
            control_plane=load_verifier(control_plane_key)
            if control_plane_key
            else Verifier(bootstrap.token_issuer(settings).public_key),
        )
    finally:
        if emulator is not None:
            emulator.stop()


def serve_fabric_managers(
    settings: Settings, *, host: str = "127.0.0.1", port: int = 8470, state_path: Path | None = None
) -> None:
    """Run the simulated fabric managers (UFM pkeys, NMX-M NVLink partitions, SDN VPCs) until
    stopped, with the tokens the control plane's clients present (`bootstrap.fabric_tokens`)."""
    bootstrap.trust_configured_ca(settings)
    fabric_main(
        host=host,
        port=port,
        state_path=state_path,
        tokens=bootstrap.fabric_tokens(settings),
        tls=settings.tls.server,
        insecure=settings.tls.insecure,
        request_body=settings.request_body,
    )
