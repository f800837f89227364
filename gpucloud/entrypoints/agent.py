"""The host agent process (`gpucloud agent`, on every GPU node): its app (`gpucloud.agent.app`)
over this node's probe, spool, workloads and weights, served with uvicorn on the action API's
address, reporting to the control plane with the node's own credential."""

from __future__ import annotations

import logging
from pathlib import Path

from gpucloud import bootstrap
from gpucloud.adapters.probe import detect_probe
from gpucloud.agent.app import Agent, create_app
from gpucloud.agent.host import HostState, read_boot_id, read_image_digest
from gpucloud.agent.kernel_log import KernelLog
from gpucloud.agent.reporting import AgentMetering, Reporter
from gpucloud.agent.signals import SignalSampler
from gpucloud.agent.ssh_keys import AuthorizedKeys
from gpucloud.agent.tenant_weights import TenantWeights
from gpucloud.agent.weights_api import health_from_probe
from gpucloud.agent.workload_logs import DEFAULT_LIMITS, LogLimits
from gpucloud.agent.workloads import WorkloadSupervisor
from gpucloud.config import Settings
from gpucloud.ledger.client import AgentLedgerToken
from gpucloud.observability import tracing
from gpucloud.sim.probe import SimulatedProbe
from gpucloud.web import tls
from gpucloud.web.http_client import async_http_client
from gpucloud.web.tls import ServerTLS, client_verify, serve_options

log = logging.getLogger(__name__)


def serve(settings: Settings, *, ledger_url: str | None = None) -> None:
    """Run the agent as `settings.agent` says (`gpucloud agent`, whose flags are already in them),
    reporting to the settings' API and metering to `ledger_url` (None: not metered)."""
    options = settings.agent
    if options.node_id is None:
        raise SystemExit("the agent needs this node's id: GPUCLOUD_AGENT__NODE_ID (or --node-id)")
    bootstrap.trust_configured_ca(settings)
    tls.trust(options.ca_file)
    token = options.token.get_secret_value() if options.token is not None else None
    if options.token_file.is_file():  # the credential the last wipe handed over wins over the first one
        token = options.token_file.read_text().strip()
    limits = LogLimits(
        max_bytes=options.workload_log_max_bytes or DEFAULT_LIMITS.max_bytes,
        files=options.workload_log_files or DEFAULT_LIMITS.files,
    )
    main(
        node_id=options.node_id,
        control_plane_url=settings.api_url,
        token=token,
        control_plane_key=options.control_plane_key,
        token_file=options.token_file,
        host=options.host,
        port=options.port,
        scratch_dir=options.scratch_dir,
        state_dir=options.state_dir,
        heartbeat_s=options.heartbeat_s,
        reading_s=options.reading_s,
        allow_simulated=options.allow_simulated,
        ledger_url=ledger_url,
        spool_path=options.spool,
        meter_interval_s=options.meter_interval_s,
        gpu_type=options.gpu_type,
        tls=ServerTLS(options.tls_cert, options.tls_key) if options.tls_cert and options.tls_key else None,
        insecure=options.insecure,
        container_runtime=options.container_runtime,
        workload_logs=limits,
        metrics_token=options.metrics_token.get_secret_value() if options.metrics_token is not None else None,
        weights_dir=options.weights_dir,
        image_digest_file=options.image_digest_file,
        tenant_disks=tuple(options.tenant_disks),
        enrollment_file=options.enrollment_file,
        ssh_user=options.ssh_user,
        authorized_keys=options.authorized_keys,
        kernel_log=options.kernel_log,
    )


def main(
    *,
    node_id: str,
    control_plane_url: str,
    token: str | None,
    control_plane_key: Path,
    token_file: Path | None = None,
    host: str = "127.0.0.1",
    port: int = 8200,
    scratch_dir: Path = Path("/var/lib/gpucloud/scratch"),
    heartbeat_s: float = 10.0,
    reading_s: float = 30.0,
    allow_simulated: bool = False,
    ledger_url: str | None = None,
    spool_path: Path = Path("/var/lib/gpucloud/usage-spool.db"),
    meter_interval_s: float = 60.0,
    gpu_type: str | None = None,
    tls: ServerTLS | None = None,
    insecure: bool = False,
    state_dir: Path = Path("/var/lib/gpucloud/agent"),
    container_runtime: str | None = None,
    workload_logs: LogLimits = DEFAULT_LIMITS,
    metrics_token: str | None = None,
    weights_dir: Path | None = None,
    image_digest_file: Path = Path("/etc/gpucloud/image-digest"),
    tenant_disks: tuple[str, ...] = (),
    enrollment_file: Path | None = None,
    ssh_user: str = "ubuntu",
    authorized_keys: Path | None = None,
    kernel_log: Path | None = None,
) -> None:
    """Run the agent until stopped: `gpucloud agent` on a GPU node. It refuses to start without
    its node's credential (`gpa_<node id>.<secret>`), unless a re-imaged boot's config drive
    (`enrollment_file`) is there to redeem for one, and without the control plane's public key."""
    import uvicorn

    drive = enrollment_file is not None and enrollment_file.is_file()
    if token is None and not drive:
        raise SystemExit(
            f"the agent needs {node_id}'s credential: issue one with `gpucloud node credential {node_id}` "
            "and pass it as --token, or boot it from the clean image with its config drive (--enrollment-file)"
        )
    if token is not None and not token.startswith(f"gpa_{node_id}."):
        raise SystemExit(
            f"the agent needs {node_id}'s own credential (gpa_{node_id}.<secret>): issue one with "
            f"`POST /v1/nodes/{node_id}/agent-credential` and pass it as --token"
        )
    if not control_plane_key.is_file():
        raise SystemExit(
            f"no control plane public key at {control_plane_key}: copy the control plane's "
            "issuer_key.pub there (or pass --control-plane-key)"
        )
    from gpucloud.web.service_tokens import load_verifier

    secure = serve_options(host, tls, insecure=insecure, what="agent's action API")
    verifier = load_verifier(control_plane_key)

    state = HostState(
        node_id=node_id,
        boot_id=read_boot_id(),
        image_digest=read_image_digest(image_digest_file),
        scratch_dir=scratch_dir,
        credential=token,
        credential_file=token_file,
        state_file=state_dir / "host.json",
    )
    state.restore()  # a restart mid-allocation: the tenant still holds the node, and is metered
    probe = detect_probe(node_id, simulated=(lambda: SimulatedProbe(node_id)) if allow_simulated else None)
    weights_dir = weights_dir or state_dir / "weights"
    # Simulated GPUs (--allow-simulated, a dev machine) have no stack to inspect.
    agent = Agent(
        state,
        probe,
        gpu_type=gpu_type,
        inspect_stack=not isinstance(probe, SimulatedProbe),
        workloads=WorkloadSupervisor(
            state_dir / "workloads", container_runtime=container_runtime, log_limits=workload_logs
        ),
        weights_dir=weights_dir,
        tenant_disks=tenant_disks,
        ssh_keys=AuthorizedKeys(ssh_user, path=authorized_keys),
    )
    if not tenant_disks:
        log.warning("no tenant disks are configured (--tenant-disk): a wipe sanitizes no disk")
    weights = TenantWeights(
        state, weights_dir, verifier=verifier, health=health_from_probe(probe), container_runtime=container_runtime
    )
    client = async_http_client(base_url=control_plane_url, timeout="agent_report", trust=client_verify())
    metering = None
    if ledger_url:
        spool_path.parent.mkdir(parents=True, exist_ok=True)
        ledger_token = AgentLedgerToken(control_plane_url, lambda: state.credential)
        metering = AgentMetering(agent, spool_path, ledger_url, interval_s=meter_interval_s, token=ledger_token)
    else:
        log.warning("no ledger URL: this node's usage is not metered")
    app = create_app(
        agent,
        Reporter(
            agent,
            client,
            enrollment_file=enrollment_file,
            signals=SignalSampler(node_id, kernel_lines=KernelLog(kernel_log)) if kernel_log else None,
        ),
        control_plane=verifier,
        heartbeat_s=heartbeat_s,
        reading_s=reading_s,
        metering=metering,
        metrics_tokens=(metrics_token,) if metrics_token else (),
        weights=weights,
    )
    tracing.instrument_app(app)  # when the command turned tracing on
    uvicorn.run(app, host=host, port=port, log_level="info", log_config=None, **secure)
