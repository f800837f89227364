"""Test harness: the real components on loopback — a simulated fleet in its own process, the
API served by uvicorn over real HTTP, a worker (in-process or a subprocess), the real Temporal
dev server and a real database."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gpucloud.config import Settings
from gpucloud.devstack.stack import free_port
from gpucloud.sim.client import SimFleetClient
from gpucloud.web.serving import ThreadedServer
from support.fabric import FabricManagers
from support.forked import CliProcess

# Polls start quick (most conditions hold within a moment) and back off to this: a long wait
# (a fleet coming up, an outage waited out) then asks the stack twice a second, not ten times,
# which on two cores shared by four test workers is CPU the stacks under test need.
_MAX_POLL_S = 0.5

# What a test's tenant is granted unless the test says otherwise: a tenant holds only the quotas
# an operator grants (none is implicit), and most tests are not about quotas. 8,192 GPUs of any
# type in any region: 1,024 nodes of 8, the largest single allocation.
GENEROUS_QUOTAS = [{"gpu_type": "*", "region": "*", "max_gpus": 8192}]


def _intervals(first_s: float):
    interval = first_s
    while True:
        yield interval
        interval = min(max(first_s, _MAX_POLL_S), interval * 1.5)


def wait_until(predicate, *, timeout_s: float = 60, interval_s: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    for interval in _intervals(interval_s):
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            break
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


async def async_wait_until(predicate, *, timeout_s: float = 60, interval_s: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    for interval in _intervals(interval_s):
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def settled_operation(client: httpx.Client, operation_id: str) -> dict | None:
    """The operation once it has left `running`, else None: for a poll (`wait_until`). An API that
    could not reach its database in time answers 503 with Retry-After, a problem document whose
    `status` is 503; that is not the operation's end, so it is asked again, as a client should."""
    resp = client.get(f"/v1/operations/{operation_id}")
    if resp.status_code == 503:
        return None
    body = resp.json()
    return body if body["status"] != "running" else None


class SimFleetProcess:
    """`gpucloud sim` in its own process (forked from one that imported the CLI already:
    `support/forked.py`); its own endpoints answer only `operator_token`."""

    def __init__(
        self,
        *,
        nodes: int,
        latency_scale: float,
        log_path: Path,
        id_prefix: str | None = None,
        extra_args: tuple[str, ...] = (),
        control_plane_key: Path | None = None,
        operator_token: str = "test-operator-token",
        api_port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        # Node ids are global in Temporal (workflow `node-<id>`): each fleet gets its own.
        self.id_prefix = id_prefix or f"t{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.operator_token = operator_token
        env = {
            **os.environ,
            "GPUCLOUD_AGENT__SIM_PORT": str(self.port),
            "GPUCLOUD_API__OPERATOR_TOKEN": operator_token,
            "GPUCLOUD_LOG_LEVEL": "WARNING",
            # Where the fleet reports what it does not do by the API's call (injected faults).
            **({"GPUCLOUD_API__PORT": str(api_port)} if api_port else {}),
            **(env or {}),
        }
        self.proc = CliProcess(
            [
                "sim",
                "--nodes",
                str(nodes),
                "--latency-scale",
                str(latency_scale),
                "--id-prefix",
                self.id_prefix,
                *(("--control-plane-key", str(control_plane_key)) if control_plane_key else ()),
                *extra_args,
            ],
            env=env,
            log_path=log_path,
        )
        self.client = SimFleetClient(self.url, token=operator_token, timeout_s=30)
        wait_until(self._up, timeout_s=30, what="simulated fleet")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"sim exited with {self.proc.returncode}")
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def inventory(self) -> list[dict]:
        return self.client.inventory()

    def node(self, node_id: str) -> dict:
        return self.client.node(node_id)

    def heartbeats(self) -> list[dict]:
        return self.client.heartbeats()

    def drift(self, node_id: str, kind: str) -> None:
        self.client.drift(node_id, kind)

    def set_unreachable(self, node_id: str, unreachable: bool) -> None:
        self.client.set_unreachable(node_id, unreachable)

    def inject(self, node_id: str, action: str, mode: str, count: int = 1) -> None:
        self.client.inject(node_id, action, mode, count)

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(10)


class ApiThread(ThreadedServer):
    """The FastAPI app served by uvicorn on the settings' port, in a thread with its own loop."""

    def __init__(self, settings: Settings) -> None:
        from gpucloud.api.app import create_app

        super().__init__(create_app(settings), host=settings.api.host, port=settings.api.port, name="api")
        self.start()


@dataclass
class Harness:
    settings: Settings
    sim: SimFleetProcess
    api: ApiThread
    log_dir: Path
    worker_procs: list[CliProcess] = field(default_factory=list)
    # The simulated fabric managers the worker applies membership through (`make_harness(fabric=True)`).
    fabric: FabricManagers | None = None
    # The in-process worker `ready_fleet` started for it.
    worker: InProcessWorker | None = None

    @property
    def operator(self) -> httpx.Client:
        return self.client(self.settings.operator_token)

    def client(self, token: str) -> httpx.Client:
        return httpx.Client(base_url=self.api.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def node_ids(self) -> list[str]:
        """The simulated fleet's node ids, in the order `enroll_fleet` enrolls them."""
        return [n["id"] for n in self.sim.inventory()]

    def enroll_fleet(self) -> list[str]:
        nodes = self.sim.inventory()
        resp = self.operator.post("/v1/nodes:enroll", json={"nodes": nodes})
        resp.raise_for_status()
        return [n["id"] for n in nodes]

    def allocate(self, token: str, **fields) -> str:
        """Create an allocation of `fields` (`node_count=2`, `nvl72_trays=4`; H100 in us-east-1
        unless they say otherwise) under a fresh Idempotency-Key; it must be accepted (202). Its id."""
        body = {"gpu_type": "H100", "region": "us-east-1", **fields}
        with self.client(token) as c:
            resp = c.post("/v1/allocations", json=body, headers={"Idempotency-Key": str(uuid.uuid4())})
        assert resp.status_code == 202, resp.text
        return resp.json()["allocation"]["id"]

    def push_heartbeats(self) -> dict:
        """What the sim's agents would send on their next heartbeat, delivered now."""
        with self.operator as op:
            resp = op.post("/v1/agents/heartbeats", json={"heartbeats": self.sim.heartbeats()})
            resp.raise_for_status()
            return resp.json()

    async def sweep(self, client, node_ids: list[str] | None = None):
        from gpucloud.models.messages import SweepInput
        from gpucloud.workflows.reconciler import ReconcileSweepWorkflow

        return await client.execute_workflow(
            ReconcileSweepWorkflow.run,
            SweepInput(node_ids=node_ids),
            id=f"test-sweep-{uuid.uuid4().hex[:8]}",
            task_queue=self.settings.temporal.task_queue,
        )

    def node(self, node_id: str) -> dict:
        with self.operator as op:
            return op.get(f"/v1/nodes/{node_id}").json()

    def nodes(self, **params) -> list[dict]:
        items, token = [], ""
        with self.operator as op:
            while True:
                query = {"page_size": 1000, **params, **({"page_token": token} if token else {})}
                resp = op.get("/v1/nodes", params=query)
                for _ in range(5):
                    # As a client should: an API that could not reach its database in time (a
                    # machine loaded by the rest of the suite) is asked again after Retry-After.
                    if resp.status_code != 503:
                        break
                    time.sleep(min(float(resp.headers.get("Retry-After", "1")), 5.0))
                    resp = op.get("/v1/nodes", params=query)
                assert resp.status_code == 200, resp.text
                page = resp.json()
                items += page["items"]
                token = page["next_page_token"]
                if not token:
                    return items

    async def wait_states(self, want: dict[str, int], *, timeout_s: float = 60) -> None:
        last: dict[str, object] = {}

        def check() -> bool:
            counts: dict[str, int] = {}
            nodes = self.nodes()
            for n in nodes:
                counts[n["state"]] = counts.get(n["state"], 0) + 1
            last["counts"] = counts
            last["others"] = [(n["id"], n["state"], n.get("allocation_id")) for n in nodes if n["state"] not in want][
                :8
            ]
            return all(counts.get(s, 0) == c for s, c in want.items())

        try:
            await async_wait_until(check, timeout_s=timeout_s, interval_s=0.2, what=f"node states {want}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last seen {last.get('counts')}, e.g. {last.get('others')}") from None

    def new_tenant(self, name: str | None = None, *, quotas: list[dict] | None = None) -> tuple[str, str]:
        """Start onboarding a tenant: (tenant id, its first API key). The tenant is `onboarding`
        until its workflow ends; it may read but not allocate: `onboard` waits for `active`.
        `quotas` left out grants `GENEROUS_QUOTAS`; `[]` grants none."""
        return self._create_tenant(name, quotas)[:2]

    async def onboard(
        self, name: str | None = None, *, quotas: list[dict] | None = None, timeout_s: float = 60
    ) -> tuple[str, str]:
        """Onboard a tenant and wait until it is active: (tenant id, its first API key)."""
        tenant_id, key, operation_id = self._create_tenant(name, quotas)
        await self.wait_operation(operation_id, timeout_s=timeout_s)
        return tenant_id, key

    def _create_tenant(self, name: str | None, quotas: list[dict] | None) -> tuple[str, str, str]:
        granted = GENEROUS_QUOTAS if quotas is None else quotas
        body = {"name": name or f"t-{uuid.uuid4().hex[:8]}", "quotas": granted}
        # As a client should: a 503 (a busy SQLite file beside another test's API) is sent again
        # after its Retry-After, under one Idempotency-Key, a few times.
        headers = {"Idempotency-Key": f"harness-{uuid.uuid4().hex}"}
        with self.operator as op:
            for _ in range(5):
                resp = op.post("/v1/tenants", json=body, headers=headers)
                if resp.status_code != 503:
                    break
                time.sleep(float(resp.headers.get("Retry-After", "1")))
        assert resp.status_code == 202, resp.text
        accepted = resp.json()
        return accepted["id"], accepted["api_key"]["key"], accepted["operation"]["id"]

    async def wait_operation(self, operation_id: str, *, timeout_s: float = 60, expect: str = "succeeded") -> dict:
        with self.operator as op:
            final = await async_wait_until(
                lambda: settled_operation(op, operation_id),
                timeout_s=timeout_s,
                interval_s=0.05,
                what=f"operation {operation_id}",
            )
        assert final["status"] == expect, final
        return final

    async def wait_allocation(self, token: str, allocation_id: str, status: str, *, timeout_s: float = 60) -> dict:
        with self.client(token) as c:
            return await async_wait_until(
                lambda: (a := c.get(f"/v1/allocations/{allocation_id}").json())["status"] == status and a,
                timeout_s=timeout_s,
                interval_s=0.2,
                what=f"allocation {allocation_id} {status}",
            )

    def start_worker_process(self) -> CliProcess:
        env = {**os.environ, **self.settings.env(), "GPUCLOUD_LOG_LEVEL": "WARNING"}
        proc = CliProcess(["worker"], env=env, log_path=self.log_dir / "worker.log")
        self.worker_procs.append(proc)
        return proc


class InProcessWorker:
    """The production workers, run on the test's event loop: the control plane's, and the
    evaluation worker with the settings its own process gets (`for_evaluation_worker`)."""

    def __init__(self, client, settings: Settings, *, fault_hook=None) -> None:
        from gpucloud import bootstrap
        from gpucloud.workers.evaluation import build_evaluation_worker
        from gpucloud.workers.main import build_worker

        self.executor = ThreadPoolExecutor(max_workers=settings.temporal.worker_max_activities)
        self.control_plane = bootstrap.control_plane(settings)
        self.workers = [
            build_worker(client, self.control_plane, executor=self.executor, fault_hook=fault_hook),
            build_evaluation_worker(client, settings.for_evaluation_worker(), executor=self.executor),
        ]
        self.tasks: list[asyncio.Task] = []

    async def __aenter__(self):
        self.tasks = [asyncio.create_task(worker.run()) for worker in self.workers]
        return self

    async def __aexit__(self, *exc) -> None:
        for worker in self.workers:
            await worker.shutdown()
        await asyncio.gather(*self.tasks)
        await self.control_plane.aclose()
        self.executor.shutdown(wait=False)
