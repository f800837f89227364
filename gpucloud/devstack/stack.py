"""The embedded stack for one laptop: Temporal dev server, billing ledger, simulated fabric
managers, worker, evaluation worker, API and simulated fleet as child processes, started in order, each waited on
until it answers, stopped in reverse.

Everything lives in the data dir (databases, logs, operator token, the agents' usage spools), so
a second `up` on the same data dir resumes where the first stopped. With `billing`, the ledger
runs with its own SQLite database, gets a default price book the first time, and the simulated
agents meter their allocations into it. With `tracker`, the weight tracker and origin (the
registry's chunks in the data dir) run on `tracker_url`, which the worker's rollouts use.
The evaluation worker runs tenants' evaluation commands, so it gets an environment of its own
with none of the platform's secrets (`evaluation_worker_env`).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from pydantic import SecretStr

from gpucloud import bootstrap, children
from gpucloud.config import Settings
from gpucloud.devstack import forked
from gpucloud.devstack.forked import ForkedChild
from gpucloud.devstack.temporal_server import server_args
from gpucloud.ledger.pricebook import list_price_book
from gpucloud.sim.client import SimFleetClient
from gpucloud.sim.fabric_managers import register_nvl_domains
from gpucloud.web import tls
from gpucloud.web.http_client import http_client
from gpucloud.web.service_tokens import LEDGER_AUDIENCE
from gpucloud.web.tls import LocalCA

# The clean image the stack serves (`Stack.clean_image`). A real one is a bootable ISO that starts
# the agent and writes its own digest where the agent reads it (`gpucloud agent
# --image-digest-file`); simulated nodes booted from it report the sha256 of these bytes.
CLEAN_IMAGE_NAME = "gpucloud-clean.iso"
CLEAN_IMAGE = b"gpucloud clean node image for the simulated fleet, v1\n"


class StackError(RuntimeError):
    pass


def with_local_tls(settings: Settings) -> Settings:
    """These settings with every server of the stack on TLS (`gpucloud up --tls`): a private CA
    and a certificate for loopback, kept in `<data dir>/tls` (a second start reuses them), which
    every client of the stack verifies against."""
    ca = LocalCA(settings.data_dir.resolve() / "tls")
    leaf = ca.issue("server", ["127.0.0.1", "localhost"])
    tracker = httpx.URL(settings.tracker.url).copy_with(scheme="https")
    return settings.model_copy(
        update={
            "tls": settings.tls.model_copy(
                update={"ca_file": ca.cert_file, "cert_file": leaf.cert_file, "key_file": leaf.key_file}
            ),
            "tracker": settings.tracker.model_copy(update={"url": str(tracker)}),
        }
    )


# Ports handed out below the kernel's ephemeral range (32768-60999 by default), at random: a port
# the kernel gave out with bind(0) and that was then closed could be taken again by the next
# outgoing connection or the next caller before its server binds it.
PORT_RANGE = (20000, 32000)
_ports = random.SystemRandom()


PORT_CLAIM_S = 600.0  # a port handed out is not handed out again, by any process here, for this long


def _claim(port: int) -> bool:
    """Claim the port for this machine's processes (a file created exclusively), so two processes
    that start servers at once never both get it between the check and the bind."""
    claims = Path(tempfile.gettempdir()) / f"gpucloud-ports-{os.getuid()}"
    claims.mkdir(exist_ok=True)
    path = claims / str(port)
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            try:
                if time.time() - path.stat().st_mtime < PORT_CLAIM_S:
                    return False
                path.unlink()  # an old claim: free it, then race for it like any other
            except FileNotFoundError:
                pass
    return False


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, for a server about to start."""
    for _ in range(200):
        port = _ports.randint(*PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if _claim(port):
            return port
    raise StackError(f"no free port in {PORT_RANGE[0]}-{PORT_RANGE[1]} on 127.0.0.1")


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


@dataclass
class Stack:
    settings: Settings
    nodes: int = 16
    ui_port: int | None = None
    sim_latency_scale: float = 1.0
    headless: bool = False
    register_fleet: bool = True
    sim_heartbeat_s: float = 10.0
    temporal_persist: bool = True
    billing: bool = False
    tracker: bool = False
    # Simulated fabric managers (UFM, NMX-M, SDN) on `fabric_url`; the worker applies every
    # allocation's fabric membership through them. Their state is kept in the data dir.
    fabric: bool = True
    nvl72_racks: int = 0
    # The simulated fleet fails as this fault model says (`gpucloud sim --faults`), sped up.
    faults: str | None = None
    fault_time_scale: float = 1.0
    faults_paused: bool = False
    # Every simulated node gets a BMC: the Redfish emulator, run by the fleet (`sim --bmc`).
    bmc: bool = False
    # Cleaning between tenants boots a known image through each node's BMC (`activities/bmc.py`):
    # with `clean_image`, the stack serves one over loopback (`images`), as an operator's boot
    # image server would, and sets `bmc.clean_image_url` and its digest for the workers.
    clean_image: bool = False
    processes: dict[str, subprocess.Popen | ForkedChild] = field(default_factory=dict)
    _fabric_port: int = field(default=0, init=False)
    _images_port: int = field(default=0, init=False)

    COMPONENTS = ("temporal", "images", "ledger", "fabric", "tracker", "worker", "evaluations", "api", "sim")

    def __post_init__(self) -> None:
        if self.clean_image:
            self._images_port = free_port()
            bmc = self.settings.bmc.model_copy(
                update={
                    "clean_image_url": f"http://127.0.0.1:{self._images_port}/{CLEAN_IMAGE_NAME}",
                    "clean_image_sha256": hashlib.sha256(CLEAN_IMAGE).hexdigest(),
                }
            )
            self.settings = self.settings.model_copy(update={"bmc": bmc})

    @property
    def fabric_url(self) -> str:
        if not self._fabric_port:
            self._fabric_port = self.settings.fabric.port or free_port()
        return f"{self.settings.tls.scheme}://127.0.0.1:{self._fabric_port}"

    @property
    def ledger_url(self) -> str:
        return f"{self.settings.tls.scheme}://{self.settings.ledger.host}:{self.settings.ledger.port}"

    @property
    def log_dir(self) -> Path:
        return self.settings.data_dir / "logs"

    @property
    def ui_url(self) -> str:
        host, port = self.settings.temporal.address.rsplit(":", 1)
        return f"http://{host}:{self.ui_port or int(port) + 1000}"

    def env(self) -> dict[str, str]:
        """The children's environment: these settings, with what the stack itself decided (the
        operator token, the database files, the ledger's and fabric managers' URLs)."""
        s = self.settings
        fabric_tokens = bootstrap.fabric_tokens(s)
        derived = s.model_copy(
            update={
                "database": s.database.model_copy(update={"url": SecretStr(s.database_url)}),
                "api": s.api.model_copy(update={"operator_token": SecretStr(s.operator_token)}),
                "ledger": s.ledger.model_copy(
                    update={
                        "url": self.ledger_url if self.billing else None,
                        "database_url": SecretStr(s.ledger_database_url),
                    }
                ),
                "fabric": s.fabric.model_copy(
                    update={
                        "url": self.fabric_url,
                        "ufm_token": SecretStr(fabric_tokens.ufm),
                        "nmx_token": SecretStr(fabric_tokens.nmx),
                        "vpc_token": SecretStr(fabric_tokens.sdn),
                    }
                )
                if self.fabric
                else s.fabric,
            }
        )
        return {**os.environ, **derived.env()}

    def _spawn(self, name: str, args: list[str], *, env: dict[str, str] | None = None) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # The child keeps its own descriptor of the log; ours closes once it is started.
        with open(self.log_dir / f"{name}.log", "ab") as log:
            # Its own session (Ctrl-C reaches `up`, which stops the children in order), and
            # SIGTERM should `up` die without stopping them (`kill -9`, the OOM killer).
            proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env or self.env(),
                start_new_session=True,
                **children.popen_kwargs(),
            )
        self.processes[name] = proc
        return proc

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "gpucloud.cli.main", *args]

    def _spawn_cli(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        """`gpucloud ARGS`, forked from the stack's fork server where it can be
        (`devstack/forked.py`: a fresh interpreter spends over a CPU-second importing)."""
        if not forked.available():
            self._spawn(name, self._cli(*args), env=env)
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.processes[name] = ForkedChild(list(args), env=env or self.env(), log_path=self.log_dir / f"{name}.log")

    def _components(self, only: tuple[str, ...] | None) -> list[str]:
        wanted = [name for name in self.COMPONENTS if only is None or name in only]
        wanted = [name for name in wanted if name != "fabric" or self.fabric]
        wanted = [name for name in wanted if name != "tracker" or self.tracker]
        wanted = [name for name in wanted if name != "images" or self.clean_image]
        return [name for name in wanted if name != "ledger" or self.billing]

    def _check_ports(self, components: list[str]) -> None:
        host, port = self.settings.temporal.address.rsplit(":", 1)
        tracker = httpx.URL(self.settings.tracker.url)
        ports = {
            "temporal": ("Temporal", host, int(port)),
            "ledger": ("ledger", self.settings.ledger.host, self.settings.ledger.port),
            "api": ("API", self.settings.api.host, self.settings.api.port),
            "sim": ("simulated fleet", self.settings.agent.sim_host, self.settings.agent.sim_port),
            "fabric": ("fabric managers", "127.0.0.1", int(self.fabric_url.rsplit(":", 1)[1])),
            "tracker": ("weight tracker", tracker.host, tracker.port or 80),
            "bmc": ("Redfish emulator", "127.0.0.1", self.settings.bmc.emulator_port),
            "images": ("boot image server", "127.0.0.1", self._images_port),
        }
        if self.bmc and "sim" in components:
            components = [*components, "bmc"]
        for what, h, p in (ports[name] for name in components if name in ports):
            if port_in_use(h, p):
                raise StackError(
                    f"port {p} for the {what} is already in use (another `gpucloud up`?); "
                    f"stop it or pick other ports with GPUCLOUD_* settings"
                )

    def start(self, on_step: Callable[[str], None] = lambda _: None, *, only: tuple[str, ...] | None = None) -> None:
        """Start the stack, or with `only` some of its components (say, after `stop(only=...)`)."""
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        bootstrap.trust_configured_ca(self.settings)  # this process checks its children's certificates too
        components = self._components(only)
        self._check_ports(components)
        if {"api", "worker", "ledger"} & set(components):
            self._migrate(on_step)
        for name in components:
            getattr(self, f"_start_{name}")(on_step)
        for worker in {"worker", "evaluations"} & set(components):
            self._ensure_alive(worker)

    def _migrate(self, on_step: Callable[[str], None]) -> None:
        """The deployment step before the processes start (they only check the schema on Postgres)."""
        from gpucloud.db import migrate
        from gpucloud.ledger.db import LedgerDatabase

        on_step("migrating the databases")
        migrate(self.settings.database_url)
        ledger = LedgerDatabase(self.settings.ledger_database_url)
        try:
            ledger.migrate()
        finally:
            ledger.dispose()

    def _start_temporal(self, on_step: Callable[[str], None]) -> None:
        _, port = self.settings.temporal.address.rsplit(":", 1)
        on_step("starting Temporal dev server")
        self._spawn(
            "temporal",
            server_args(
                self.settings.data_dir.resolve(),
                port=int(port),
                ui_port=self.ui_port,
                headless=self.headless,
                persist=self.temporal_persist,
            ),
        )
        self._wait("temporal", self._temporal_ready, 90)

    def _start_images(self, on_step: Callable[[str], None]) -> None:
        """The clean image, read-only over loopback HTTP: what a BMC's virtual media fetches."""
        on_step("starting boot image server")
        images = self.settings.data_dir.resolve() / "images"
        images.mkdir(parents=True, exist_ok=True)
        (images / CLEAN_IMAGE_NAME).write_bytes(CLEAN_IMAGE)
        port = str(self._images_port)
        self._spawn(
            "images", [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(images), port]
        )
        self._wait("images", lambda: self._http_ok(self.settings.bmc.clean_image_url or ""), 30)

    def _start_ledger(self, on_step: Callable[[str], None]) -> None:
        on_step("starting billing ledger")
        issuer = bootstrap.token_issuer(self.settings)  # the key the ledger trusts, made before it starts
        self._spawn_cli("ledger", "ledger")
        self._wait("ledger", lambda: self._http_ok(f"{self.ledger_url}/healthz"), 60)
        with http_client(base_url=self.ledger_url, timeout="ledger_seed", trust=tls.client_verify()) as ledger:
            seed_price_book(ledger, issuer.mint(LEDGER_AUDIENCE, subject="operator", role="operator"))

    def _start_fabric(self, on_step: Callable[[str], None]) -> None:
        on_step("starting simulated fabric managers")
        port = self.fabric_url.rsplit(":", 1)[1]
        self._spawn_cli(
            "fabric",
            "fabric-managers",
            "--port",
            port,
            "--state",
            str(self.settings.data_dir.resolve() / "fabric.json"),
        )
        self._wait("fabric", lambda: self._http_ok(f"{self.fabric_url}/healthz"), 60)

    def _start_tracker(self, on_step: Callable[[str], None]) -> None:
        on_step("starting weight tracker")
        bootstrap.token_issuer(self.settings)  # the key (and its public half) the tracker trusts
        self._spawn_cli("tracker", "tracker")
        self._wait("tracker", lambda: self._http_ok(f"{self.settings.tracker.url}/healthz"), 60)

    def _start_worker(self, on_step: Callable[[str], None]) -> None:
        on_step("starting worker")
        self._spawn_cli("worker", "worker")

    def _start_evaluations(self, on_step: Callable[[str], None]) -> None:
        on_step("starting evaluation worker")
        env = evaluation_worker_env(self.settings)
        self._spawn("evaluations", self._cli("worker", "--role", "evaluation"), env=env)

    def _start_api(self, on_step: Callable[[str], None]) -> None:
        on_step("starting API")
        # The API gets a delegate of the issuer key (ledger tokens only), never the key itself.
        delegate = bootstrap.issue_api_delegate(self.settings)
        env = {key: value for key, value in self.env().items() if key != "GPUCLOUD_AGENT__ISSUER_KEY"}
        env["GPUCLOUD_API__DELEGATE_KEY"] = str(delegate)
        self._spawn_cli("api", "api", "--workers", str(api_processes(self.settings)), env=env)
        self._wait("api", lambda: self._http_ok(f"{self.settings.api_url}/healthz"), 60)

    def _start_sim(self, on_step: Callable[[str], None]) -> None:
        on_step(f"starting simulated fleet ({self.nodes} nodes)")
        register = ["--register"] if self.register_fleet else []
        metering = ["--ledger-url", self.ledger_url] if self.billing and self.register_fleet else []
        nvl72 = ["--nvl72-racks", str(self.nvl72_racks)] if self.nvl72_racks else []
        faults = ["--faults", self.faults, "--time-scale", str(self.fault_time_scale)] if self.faults else []
        faults += ["--faults-paused"] if self.faults and self.faults_paused else []
        faults += ["--bmc"] if self.bmc else []
        from gpucloud.models.catalog import NVL72_TRAYS_PER_RACK
        from gpucloud.sim.nodes import MAX_SSH_NODES

        # Each node takes SSH on a loopback port of its own, as far as a listener a node fits.
        ssh = ["--ssh"] if self.nodes + self.nvl72_racks * NVL72_TRAYS_PER_RACK <= MAX_SSH_NODES else []
        self._spawn_cli(
            "sim",
            "sim",
            "--nodes",
            str(self.nodes),
            *register,
            *metering,
            *nvl72,
            *faults,
            *ssh,
            "--latency-scale",
            str(self.sim_latency_scale),
            "--heartbeat-interval",
            str(self.sim_heartbeat_s),
        )
        self._wait("sim", lambda: self._http_ok(f"{self.settings.sim_url}/healthz"), 60)
        if self.fabric and self.nvl72_racks:
            # Real NMX-M discovers each NVL72 rack's GPUs; the simulated one is told.
            nmx_token = bootstrap.fabric_tokens(self.settings).nmx
            with self._sim() as sim:
                register_nvl_domains(self.fabric_url, sim.inventory(), nmx_token=nmx_token)

    def _sim(self) -> SimFleetClient:
        return SimFleetClient(self.settings.sim_url, token=self.settings.operator_token, timeout_s=30)

    def _temporal_ready(self) -> bool:
        from gpucloud.adapters.temporal import codec_keys, connect
        from gpucloud.adapters.temporal_gateway import count_workflows

        keys = codec_keys(self.settings)

        async def probe() -> bool:
            try:
                client = await connect(self.settings.temporal, keys=keys)
                await count_workflows(client)
                return True
            except Exception:
                return False

        return asyncio.run(probe())

    @staticmethod
    def _http_ok(url: str) -> bool:
        try:
            with http_client(timeout="readiness", trust=tls.client_verify()) as client:
                return client.get(url).status_code == 200
        except httpx.HTTPError:
            return False

    def _ensure_alive(self, name: str) -> None:
        proc = self.processes[name]
        if proc.poll() is not None:
            raise StackError(f"{name} exited with code {proc.returncode}; see {self.log_dir / (name + '.log')}")

    def _wait(self, name: str, ready: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._ensure_alive(name)
            if ready():
                return
            time.sleep(0.3)
        raise StackError(f"{name} did not become ready within {timeout_s:.0f}s; see {self.log_dir / (name + '.log')}")

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.processes.values())

    def stop(self, timeout_s: float = 15.0, *, only: tuple[str, ...] | None = None) -> None:
        """Stop every component in reverse start order, or only those named."""
        for name in reversed(list(self.processes)):
            if only is not None and name not in only:
                continue
            proc = self.processes.pop(name)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def evaluation_worker_env(settings: Settings) -> dict[str, str]:
    """The evaluation worker's environment: this one without any `GPUCLOUD_*` variable (a
    secret set in the operator's shell, the secrets dir), then its own settings, which hold
    none of the platform's secrets (`Settings.for_evaluation_worker`)."""
    inherited = {key: value for key, value in os.environ.items() if not key.startswith("GPUCLOUD_")}
    # Only the sections its settings were given (`for_evaluation_worker` names them): every other
    # one is its default, which it builds itself (the agent's, say, is none of its business).
    worker = settings.for_evaluation_worker()
    given = {section.upper() for section in worker.model_fields_set}
    own = {
        key: value
        for key, value in worker.env().items()
        if "__" not in key or key.removeprefix("GPUCLOUD_").partition("__")[0] in given
    }
    return {**inherited, **own}


def seed_price_book(ledger: httpx.Client, operator_token: str) -> bool:
    """Give a ledger without any price book the list prices (`ledger.pricebook.list_price_book`),
    as the operator (a token the control plane signed for the ledger); True if it seeded one."""
    auth = {"Authorization": f"Bearer {operator_token}"}
    versions = ledger.get("/v1/price-book/versions", headers=auth)
    versions.raise_for_status()
    if versions.json():
        return False
    created = ledger.post("/v1/price-book/versions", headers=auth, json=list_price_book().model_dump(mode="json"))
    if created.status_code not in (201, 409):  # 409: another start seeded it meanwhile
        raise StackError(f"the ledger refused the default price book: {created.text[:300]}")
    return created.status_code == 201


def api_processes(settings: Settings) -> int:
    """How many API processes `up` runs: `api.workers` where it is set; else two where the
    database serves several (Postgres), one on SQLite (one writer)."""
    if "workers" in settings.api.model_fields_set or settings.database_url.startswith("sqlite"):
        return max(1, settings.api.workers)
    return 2
