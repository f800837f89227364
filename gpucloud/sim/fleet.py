"""A simulated fleet: N host agents served by one process over HTTP (one port, per-node paths).

Each simulated agent is the real agent's action core (`agent/action_core.py`) over simulated
hardware (`nodes.py`), so it answers the action API as the real one does and enforces the same
invariants: a node holding one tenant's data cannot be provisioned for another before a wipe; a
wipe refuses while a workload runs; burn-in runs only on a wiped node. Actions take realistic
(scaled) time and are deduplicated by request id, and a fault model lets tests make any action
fail transiently (HTTP 503) or permanently (HTTP 422).

Hardware faults: a node can be given a fault (say, a GPU off the bus) that burn-in detects
(HTTP 422) until the repair ladder's rung that fixes it has run: `fixed_by` a reset yields to any
rung, a reboot to a reboot or reflash, a reflash only to a reflash, and none to nothing
(the node is headed for RMA).

NVL72 racks (optional, `nvl72_racks`): GB200 compute trays (4 GPUs, 4 InfiniBand ports each) in
racks whose GPUs share one NVLink domain, after the default pool; every tray reports its GPUs'
UIDs, the members of NVLink partitions.

Metering (optional, `metering=`): each node's agent meters the GPU time of the allocation it
runs into a durable spool and ships it to the billing ledger, as a real agent does (see
`metering.py`); `GET /v1/metering` reports what was metered, the ground truth for tests.

SSH (optional, `FleetSpec.ssh`): each node takes SSH on a loopback port of its own, letting in
the keys of the workload it runs, with a restricted shell that executes nothing (`ssh.py`).

Weights (optional, `weights=`): each node serves the agent's weights API and peer service under
its agent URL, over a real chunk cache of its own (see `node_weights.py`), so staged rollouts run
against the simulated fleet.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import threading
from collections import deque
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import httpx
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Scope

from gpucloud.agent.action_core import answer_action
from gpucloud.agent.peer import swarm_refusal
from gpucloud.config import RequestBodySettings
from gpucloud.ledger.client import AgentLedgerToken
from gpucloud.protocol.actions import ActionRequest, AgentAction
from gpucloud.protocol.reporter import ReportClient
from gpucloud.protocol.reports import Heartbeat
from gpucloud.retry import Backoff, retry_call_async
from gpucloud.sim.fault_injection import FleetFaults, post_signal_reports, switch_down_reports
from gpucloud.sim.faults import FaultModel
from gpucloud.sim.metering import FleetMetering, MeteringSpec, WorkloadFollower
from gpucloud.sim.node_weights import NodeWeights, WeightsSpec
from gpucloud.sim.nodes import Fleet, FleetSpec
from gpucloud.sim.power import BmcLink, SimPower
from gpucloud.sim.workload_logs_api import install_workload_logs
from gpucloud.web import problems, tls
from gpucloud.web.gate import BODY_DEFAULTS, OPEN_PATHS, Check, Gate, holds_token, query_value
from gpucloud.web.http_client import async_http_client
from gpucloud.web.service_tokens import Verifier, logs_refusal_reason, refusal_reason
from gpucloud.web.tls import ServerTLS, scheme, serve_options

log = logging.getLogger(__name__)
A = AgentAction


class FaultRequest(BaseModel):
    node_id: str
    action: AgentAction
    mode: Literal["transient", "permanent"]
    count: int = Field(1, ge=1, le=1000)


class SwitchFaultRequest(BaseModel):
    switch_id: str = Field(min_length=1, max_length=128)


class FaultsRunning(BaseModel):
    running: bool
    # With `running`: inject at least this many faults of every category within the next
    # `over_fleet_s` of fleet time (`FleetFaults.top_up`), for runs too short for the rare ones.
    minimum_per_category: int = Field(0, ge=0, le=100)
    over_fleet_s: float | None = Field(None, gt=0)


class HardwareFaultRequest(BaseModel):
    fault: str | None = Field(None, max_length=200, description="None clears the fault")
    fixed_by: Literal[A.RESET, A.REBOOT, A.REFLASH] | None = None


class DriftRequest(BaseModel):
    kind: Literal[A.REBOOT, A.WIPE, "replace_agent"]


class ReachabilityRequest(BaseModel):
    unreachable: bool


# Between enrollment attempts while the control plane does not answer.
ENROLL_BACKOFF = Backoff(first_s=0.2, cap_s=5.0)


def _not_answering(error: BaseException) -> bool:
    """A control plane not up yet, or failing for now; a 4xx is its answer."""
    if isinstance(error, httpx.HTTPStatusError):
        return error.response.status_code >= 500
    return isinstance(error, httpx.TransportError)


async def _post_until_accepted(client: httpx.AsyncClient, url: str, body: dict) -> None:
    async def post() -> None:
        (await client.post(url, json=body)).raise_for_status()

    # Until it answers, however long: the fleet is of no use to a control plane it is not in.
    await retry_call_async(post, retry_on=_not_answering, backoff=ENROLL_BACKOFF, attempts=None, deadline_s=None)


async def register_with_control_plane(
    fleet: Fleet,
    base_url: str,
    control_plane_url: str,
    token: str,
    *,
    batch: int = 500,
    heartbeat_interval_s: float = 10.0,
    batch_reports: bool = False,
) -> None:
    """Enroll every node through the control plane's API (retrying until it answers), then
    report every reachable agent's state each interval, as real agents do: each node with its
    own credential (the one its last wipe handed over), one heartbeat a request. A node not yet
    wiped holds no credential; those, and with `batch_reports` every node, are reported in
    batches under the operator token (an explicit option for fleets too large to report one by
    one on one machine)."""
    inventory = fleet.inventory(base_url)
    async with async_http_client(
        timeout="agent_report_batch", headers={"Authorization": f"Bearer {token}"}, trust=tls.client_verify()
    ) as client:
        for start in range(0, len(inventory), batch):
            await _post_until_accepted(
                client, f"{control_plane_url}/v1/nodes:enroll", {"nodes": inventory[start : start + batch]}
            )
        log.info("registered %d nodes with %s", len(inventory), control_plane_url)
        while heartbeat_interval_s > 0:
            await _report(client, fleet, control_plane_url, batch_reports=batch_reports)
            await asyncio.sleep(heartbeat_interval_s)


REPORTS_IN_FLIGHT = 32


async def _report(client: httpx.AsyncClient, fleet: Fleet, control_plane_url: str, *, batch_reports: bool) -> None:
    reports = ReportClient(client, control_plane_url)
    beats = fleet.heartbeats()
    own = [] if batch_reports else [b for b in beats if fleet.nodes[b.node_id].credential]
    rest = [b for b in beats if batch_reports or not fleet.nodes[b.node_id].credential]
    gate = asyncio.Semaphore(REPORTS_IN_FLIGHT)

    async def one(beat: Heartbeat) -> None:
        async with gate:
            try:
                answer = await reports.heartbeats([beat], credential=fleet.nodes[beat.node_id].credential)
                if answer.status_code >= 400:
                    log.warning("heartbeat of %s refused: HTTP %d", beat.node_id, answer.status_code)
            except httpx.HTTPError as exc:
                log.warning("heartbeat of %s not delivered: %s", beat.node_id, exc)

    await asyncio.gather(*(one(b) for b in own))
    for start in range(0, len(rest), 2000):
        try:
            await reports.heartbeats(rest[start : start + 2000])
        except httpx.HTTPError as exc:
            log.warning("heartbeats not delivered: %s", exc)


def create_app(
    spec: FleetSpec,
    *,
    base_url: str,
    control_plane_url: str | None = None,
    operator_token: str | None = None,
    heartbeat_interval_s: float = 10.0,
    metering: MeteringSpec | None = None,
    weights: WeightsSpec | None = None,
    control_plane: Verifier | None = None,
    batch_reports: bool = False,
    control_token: str | None = None,
    fault_model: FaultModel | None = None,
    fault_time_scale: float = 1.0,
    fault_report_url: str | None = None,
    faults_paused: bool = False,
    bmc: BmcLink | None = None,
    request_body: RequestBodySettings = BODY_DEFAULTS,
) -> FastAPI:
    """`metering`: the agents meter their allocations' GPU time and ship it to that ledger;
    `weights`: each node serves the weights API under its agent URL; `control_plane`: each
    node's actions answer only a token the control plane signed for that node, as a real
    agent's do (None: unchecked, for the fleet model's own tests); `control_token`: the
    simulator's own endpoints (inventory, faults, outages) answer only it (the operator token);
    `fault_model`: the nodes fail as the model says, `fault_time_scale` times faster than real
    time (`sim/fault_injection.py`), their XIDs and signals reported to `fault_report_url` (the
    API; default `control_plane_url`), where a failed leaf switch's nodes report their links down
    too (`POST /v1/faults/switch_down`); `bmc`: the nodes' power follows their systems on that
    Redfish emulator, which notifies `/v1/bmc/notify` (`sim/power.py`); `request_body`: how the
    gate reads bodies (`web/gate.py`), after it checks the caller as `_callers` says."""
    fleet = Fleet(spec)
    power = SimPower(fleet, bmc) if bmc is not None else None
    if power is not None:
        fleet.bmc_fields = power.inventory_fields
    faults = (
        FleetFaults(
            fleet.nodes,
            model=fault_model,
            time_scale=fault_time_scale,
            seed=spec.seed,
            control_plane_url=fault_report_url or control_plane_url,
            operator_token=operator_token or control_token,
        )
        if fault_model is not None
        else None
    )
    if faults is not None:
        faults.running = not faults_paused

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await fleet.start_ssh()  # before the inventory is read: it names each node's SSH port
        task = None
        if control_plane_url and operator_token:
            task = asyncio.create_task(
                register_with_control_plane(
                    fleet,
                    base_url,
                    control_plane_url,
                    operator_token,
                    heartbeat_interval_s=heartbeat_interval_s,
                    batch_reports=batch_reports,
                )
            )
        stop_metering = threading.Event()
        meter_thread = None
        if metering is not None:
            token = None
            if control_plane_url and operator_token:
                operator = operator_token
                token = AgentLedgerToken(control_plane_url, lambda: operator)
            app.state.metering = FleetMetering(
                metering.spool_dir,
                metering.ledger_url,
                interval_ms=max(1, int(metering.interval_s * 1000)),
                node_ids=fleet.nodes,
                token=token,
            )
            fleet.on_workload_change = WorkloadFollower(
                app.state.metering, control_plane_url=control_plane_url, operator_token=operator_token
            )
            meter_thread = threading.Thread(
                target=app.state.metering.run, args=(stop_metering,), name="metering", daemon=True
            )
            meter_thread.start()
        injecting = asyncio.create_task(faults.run()) if faults is not None else None
        yield
        if injecting is not None:
            injecting.cancel()
        if task is not None:
            task.cancel()
        if meter_thread is not None:
            stop_metering.set()
            meter_thread.join(timeout=30)
            app.state.metering.close()
        if fleet.ssh is not None:
            await fleet.ssh.close()

    app = FastAPI(title="gpucloud simulated fleet", lifespan=lifespan)
    problems.install(app)

    app.add_middleware(Gate, check=_callers(control_plane, control_token), body=request_body)
    app.state.fleet = fleet
    app.state.metering = None

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True, "nodes": len(fleet.nodes)}

    @app.put("/v1/bmc/notify")
    async def bmc_notify(
        request: Request, token: Annotated[str, Query(description="the operator token (checked by the gate)")] = ""
    ) -> dict:
        """The Redfish emulator's external notifier (it sends no header: the token is in the URL)."""
        if power is None:
            raise HTTPException(404, "this fleet has no BMCs")
        await power.notified(await request.json())
        return {"ok": True}

    @app.get("/v1/inventory")
    async def inventory() -> list[dict]:
        return fleet.inventory(base_url)

    @app.get("/v1/nodes/{node_id}")
    async def get_node(node_id: str) -> dict:
        """What the agent would answer, and the simulated host's own state (the world's view)."""
        node = fleet.node(node_id)
        powered = power is None or node.id not in power.powered_off
        world = {
            "unreachable": node.unreachable,
            "boot_id": node.boot_id,
            "powered": powered,
            "credential_from": node.credential_from,
        }
        # The image the host really booted (what a stand-in agent would claim differs).
        return Fleet.describe(node) | world | {"image_digest": node.image_digest}

    @app.post("/v1/nodes/{node_id}/actions/{action}")
    async def act(node_id: str, action: str, req: ActionRequest) -> JSONResponse:
        return await answer_action(action, req, lambda known, request: fleet.act(fleet.node(node_id), known, request))

    @app.get("/v1/nodes/{node_id}/credential")
    async def credential(node_id: str) -> dict:
        """The agent credential the node's last wipe handed over (what a real agent keeps on disk)."""
        return {"node_id": node_id, "credential": fleet.node(node_id).credential}

    @app.post("/v1/faults")
    async def inject(req: FaultRequest) -> dict:
        node = fleet.node(req.node_id)
        node.faults.setdefault(req.action, deque()).extend([req.mode] * req.count)
        return {"node_id": node.id, "action": req.action, "pending": list(node.faults[req.action])}

    @app.post("/v1/faults/switch_down")
    async def switch_down(req: SwitchFaultRequest) -> dict:
        """Fail a leaf switch: every node behind it loses all its fabric links at once, and each
        reports its ports down to the control plane (by its own credential, as its agent would)."""
        nodes = fleet.behind_switch(req.switch_id)
        for node in nodes:
            node.links_down = True
        reported = 0
        report_url = fault_report_url or control_plane_url
        if report_url:
            at = datetime.now(UTC)
            reports = switch_down_reports(nodes, switch_id=req.switch_id, at=at)
            reported = await post_signal_reports(
                fleet.nodes, reports, control_plane_url=report_url, operator_token=operator_token or control_token
            )
        return {"switch_id": req.switch_id, "down": True, "nodes": [n.id for n in nodes], "reported": reported}

    @app.post("/v1/faults/switch_up")
    async def switch_up(req: SwitchFaultRequest) -> dict:
        """The leaf switch is back: its nodes' links come up (they report nothing more)."""
        nodes = fleet.behind_switch(req.switch_id)
        for node in nodes:
            node.links_down = False
        return {"switch_id": req.switch_id, "down": False, "nodes": [n.id for n in nodes], "reported": 0}

    def injecting() -> FleetFaults:
        if faults is None:
            raise HTTPException(404, "this fleet injects no faults (start it with --faults llama3)")
        return faults

    @app.get("/v1/faults")
    async def faults_report() -> dict:
        """What the fault model injected so far, by category, next to the paper's shares."""
        return injecting().summary()

    @app.put("/v1/faults/running")
    async def faults_running(req: FaultsRunning) -> dict:
        """Pause or resume the fault model (a benchmark starts it once its tenants hold nodes),
        optionally with a minimum of every category over the fleet time to come."""
        injecting().running = req.running
        if req.running and req.minimum_per_category and req.over_fleet_s:
            injecting().top_up(req.minimum_per_category, req.over_fleet_s)
        return injecting().summary()

    @app.post("/v1/nodes/{node_id}/hardware_fault")
    async def hardware_fault(node_id: str, req: HardwareFaultRequest) -> dict:
        node = fleet.node(node_id)
        node.hardware_fault, node.fault_fixed_by = req.fault, req.fixed_by if req.fault else None
        return Fleet.describe(node)

    @app.post("/v1/nodes/{node_id}/drift")
    async def drift(node_id: str, req: DriftRequest) -> dict:
        node = fleet.node(node_id)
        fleet.drift(node, req.kind)
        await fleet.workload_changed(node)
        return Fleet.describe(node)

    @app.post("/v1/nodes/{node_id}/reachability")
    async def reachability(node_id: str, req: ReachabilityRequest) -> dict:
        node = fleet.node(node_id)
        node.unreachable = req.unreachable
        return Fleet.describe(node) | {"unreachable": node.unreachable}

    install_workload_logs(app, fleet)

    @app.get("/v1/heartbeats")
    async def heartbeats() -> list[Heartbeat]:
        return fleet.heartbeats()

    @app.get("/v1/metering")
    async def metering_report() -> dict:
        """What each node metered (allocations and their intervals) and how far its spool is behind."""
        if app.state.metering is None:
            raise HTTPException(404, "this fleet does not meter usage (start it with --ledger-url)")
        return await asyncio.to_thread(app.state.metering.report)

    if weights is not None:  # last: every route above takes precedence over the mount
        app.mount("/v1/nodes/{node_id}", NodeWeights(fleet.nodes, weights, control_plane=control_plane))
    return app


_NODE_PATH = re.compile(r"^/v1/nodes/([^/]+)/(actions|weights|chunks|workload)/")


def _callers(control_plane: Verifier | None, control_token: str | None) -> Check:
    """Who may call the simulated fleet, checked by its gate before a body is read: each node's
    agent routes (actions, the weights API) the control plane's token for that node, as a real
    agent's do (None: unchecked); a node's chunks a rollout's token for the swarm; the BMC
    notifier the operator token in its URL (the emulator sends no header); the simulator's own
    endpoints (the world: faults, outages, what nodes hold) the operator token (`control_token`;
    None: unchecked)."""

    async def check(scope: Scope) -> ASGIApp | None:
        path = scope["path"]
        if path in OPEN_PATHS:
            return None
        node = _NODE_PATH.match(path)
        if node is not None and node.group(2) == "chunks":
            swarm = query_value(scope, "swarm")
            return swarm_refusal(control_plane, swarm, problems.header(scope, b"authorization"), tenant=None)
        if node is not None and node.group(2) == "workload":  # its output: a log reader's token too
            reason = logs_refusal_reason(control_plane, problems.header(scope, b"authorization"), node_id=node.group(1))
            return problems.unauthenticated(reason) if reason else None
        if node is not None:
            reason = refusal_reason(control_plane, problems.header(scope, b"authorization"), node_id=node.group(1))
            return problems.unauthenticated(reason) if reason else None
        if control_token is None:
            return None
        if path == "/v1/bmc/notify":
            given = query_value(scope, "token") or ""
            if hmac.compare_digest(given.encode(), control_token.encode()):
                return None
            return problems.unauthenticated("the BMC notifier's URL carries the operator token")
        if holds_token(scope, control_token):
            return None
        return problems.unauthenticated("the simulator's own endpoints answer only the operator token")

    return check


def serve(
    spec: FleetSpec, *, host: str, port: int, tls: ServerTLS | None = None, insecure: bool = False, **options: Any
) -> None:
    """Serve `create_app(spec, **options)` on host:port until stopped (`gpucloud sim`)."""
    import uvicorn

    secure = serve_options(host, tls, insecure=insecure, what="simulated fleet")
    app = create_app(spec, base_url=f"{scheme(tls)}://{host}:{port}", **options)
    uvicorn.run(app, host=host, port=port, log_level="warning", backlog=4096, log_config=None, **secure)
