"""The simulated fleet's nodes. Each answers an action with the production agent's own code, the
action core (`agent/action_core.py`: its invariants, its request-id memory, its order of steps,
its answers), over simulated hardware (`SimulatedHardware`): realistic latencies, injected action
failures, hardware faults that only the right repair rung clears, a wipe's cleaning as the real
agent reports it. Around it, the world: drift behind the control plane's back, agents that do not
answer, a stand-in agent that lies about the image it booted."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from fastapi import HTTPException
from pydantic import BaseModel, Field, model_validator

from gpucloud.agent.action_core import ACTION_FAILED, ActionCore, NodeFacts, Outcome, action_failed, problem
from gpucloud.agent.cleaning import CleaningFailed
from gpucloud.protocol.actions import (
    DISK_SANITIZE,
    GPU_RESET,
    REPAIR_LADDER,
    SCRATCH,
    ActionRequest,
    AgentAction,
    CleaningStep,
    Diagnosis,
    DiagnosticCheck,
)
from gpucloud.protocol.reports import Heartbeat, Signal, SignalObservation, WorkloadStatus, utc_now
from gpucloud.sim.ssh import LOOPBACK, FleetSsh
from gpucloud.sim.workload_output import SimulatedRun, simulate

log = logging.getLogger(__name__)

A = AgentAction

# Seconds each action takes on the simulated hardware at speed 1.0 (real hardware: minutes).
BASE_LATENCY_S = {
    A.INSPECT: 0.2,
    A.BURN_IN: 0.5,
    A.PROVISION: 0.4,
    A.RELEASE: 0.1,
    A.WIPE: 0.3,
    A.RESET: 0.1,
    A.REBOOT: 0.4,
    A.REFLASH: 0.6,
    A.DIAGNOSE: 0.2,
}
# Fewer answers kept per node than a real agent keeps: thousands of nodes share one process.
REMEMBERED_REQUESTS = 16
# The disks a simulated node's tenant writes to, each crypto-erased by a wipe (`--tenant-disk`).
TENANT_DISKS = ("/dev/nvme1n1",)
# SSH endpoints are a listener (a file descriptor) a node: fleets past this many take none.
MAX_SSH_NODES = 4096


class FleetSpec(BaseModel):
    nodes: int = Field(16, ge=1, le=100_000)
    region: str = "us-east-1"
    gpu_type: str = "H100"
    gpus_per_node: int = 8
    nodes_per_rack: int = 4
    racks_per_pod: int = 8
    # Every rack has its own leaf (top-of-rack) switch; one PDU feeds this many racks of a pod.
    racks_per_pdu: int = Field(2, ge=1)
    latency_scale: float = Field(1.0, ge=0.0, description="0 = instant, 1 = the defaults above")
    provision_s: float | None = Field(
        None, ge=0.0, description="every provision takes exactly this long (a slow image pull, say)"
    )
    diagnose_s: float | None = Field(None, ge=0.0, description="every scheduled diagnose takes exactly this long")
    seed: int = 0
    id_prefix: str = "sim"
    # GB200 NVL72 racks after the default pool (numbered on from it), `racks_per_pod` to a pod.
    nvl72_racks: int = Field(0, ge=0, le=1000)
    nvl72_trays_per_rack: int = Field(18, ge=1, le=18)
    # Every node takes SSH on a loopback port of its own (`sim/ssh.py`), as this login user.
    ssh: bool = False
    ssh_user: str = "ubuntu"

    @model_validator(mode="after")
    def _ssh_fits(self) -> FleetSpec:
        total = self.nodes + self.nvl72_racks * self.nvl72_trays_per_rack
        if self.ssh and total > MAX_SSH_NODES:
            raise ValueError(f"SSH endpoints are a listener a node: at most {MAX_SSH_NODES} nodes, not {total}")
        return self


@dataclass
class SimNode:
    id: str
    hostname: str
    region: str
    pod: str
    rack: str
    gpu_type: str
    gpu_count: int
    ib_port_guids: list[str]
    nvlink_domain: str | None = None
    gpu_uids: list[str] = field(default_factory=list)
    leaf_switch: str | None = None  # the switch its fabric ports hang off
    pdu: str | None = None  # the PDU that feeds it
    links_down: bool = False  # its leaf switch failed: every fabric port is down
    tenant_id: str | None = None
    workload_running: bool = False
    # The command the allocation's provision started (a simulated node runs nothing).
    workload: list[str] | None = None
    # How the simulator plays that workload (`sim/workload_output.py`), and when it started
    # (the fleet's clock).
    workload_run: SimulatedRun | None = None
    workload_started_s: float = 0.0
    allocation_id: str | None = None  # what the last provision named (metering)
    actions_done: int = 0
    boot_id: int = 0
    unreachable: bool = False  # no heartbeats, every action answers 503
    hardware_fault: str | None = None  # what burn-in finds wrong, until a repair fixes it
    fault_fixed_by: AgentAction | None = None  # the mildest repair rung that fixes it; None: nothing does
    credential: str | None = None  # the agent credential the last wipe handed over
    # Where it came from: "in_band" (a wipe's) or "config_drive" (a re-image's one-time enrollment).
    credential_from: str | None = None
    # What the node's agent reports it booted: the sha256 of the image its BMC's virtual CD held
    # at power-on (`sim/power.py`), None when it booted from its disk.
    image_digest: str | None = None
    # The tenant replaced the agent with a stand-in that claims an image it did not boot (as if
    # it lived on below the OS, in firmware the re-image does not touch).
    stand_in: bool = False
    tenant_disks: tuple[str, ...] = TENANT_DISKS
    # The public keys the current allocation's workload let in (its SSH endpoint reads them).
    ssh_keys: tuple[str, ...] = ()
    recent: OrderedDict = field(default_factory=OrderedDict)  # request_id -> (status, body)
    faults: dict[AgentAction, deque] = field(default_factory=dict)  # action -> modes to apply, in order
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


# What a stand-in agent claims to have booted: not the clean image (one that claimed the clean
# image's digest would pass; an attested boot report is what would catch it).
STAND_IN_DIGEST = "sha256:" + "5" * 64


class Fleet:
    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.nodes: dict[str, SimNode] = {}
        self.clock: Callable[[], float] = time.monotonic  # what a simulated workload's time runs on
        # Called after every action that may have started or stopped a node's workload (metering).
        self.on_workload_change: Callable[[SimNode], Awaitable[None]] | None = None
        # Each node's BMC as enrollment names it (`sim/power.py`), when the fleet has BMCs.
        self.bmc_fields: Callable[[str], dict] | None = None
        # The nodes' SSH endpoints (`start_ssh`), when the spec asks for them.
        self.ssh: FleetSsh | None = None
        per_pod = spec.nodes_per_rack * spec.racks_per_pod
        for i in range(spec.nodes):
            pod, rack = i // per_pod, (i % per_pod) // spec.nodes_per_rack
            node_id = f"{spec.id_prefix}-{i:05d}"
            self.nodes[node_id] = SimNode(
                id=node_id,
                hostname=f"{spec.id_prefix}-gpu-{i:05d}.{spec.region}.internal",
                region=spec.region,
                pod=f"{spec.region}-pod{pod:03d}",
                rack=f"{spec.region}-pod{pod:03d}-rack{rack:02d}",
                leaf_switch=f"{spec.region}-pod{pod:03d}-rack{rack:02d}-leaf",
                pdu=f"{spec.region}-pod{pod:03d}-pdu{rack // spec.racks_per_pdu:02d}",
                gpu_type=spec.gpu_type,
                gpu_count=spec.gpus_per_node,
                ib_port_guids=_port_guids(spec, i, spec.gpus_per_node),
            )
        self._add_nvl72_racks(spec)

    def _add_nvl72_racks(self, spec: FleetSpec) -> None:
        gpus = 4  # a GB200 compute tray: two Grace CPUs, four Blackwell GPUs, four ConnectX-7
        for rack_index in range(spec.nvl72_racks):
            pod = f"{spec.region}-nvl72pod{rack_index // spec.racks_per_pod:03d}"
            rack = f"{pod}-rack{rack_index % spec.racks_per_pod:02d}"
            for tray in range(spec.nvl72_trays_per_rack):
                i = spec.nodes + rack_index * spec.nvl72_trays_per_rack + tray
                node_id = f"{spec.id_prefix}-{i:05d}"
                self.nodes[node_id] = SimNode(
                    id=node_id,
                    hostname=f"{spec.id_prefix}-gb200-{i:05d}.{spec.region}.internal",
                    region=spec.region,
                    pod=pod,
                    rack=rack,
                    leaf_switch=f"{rack}-leaf",
                    pdu=f"{pod}-pdu{(rack_index % spec.racks_per_pod) // spec.racks_per_pdu:02d}",
                    gpu_type="GB200",
                    gpu_count=gpus,
                    ib_port_guids=_port_guids(spec, i, gpus),
                    nvlink_domain=f"{spec.id_prefix}-nvl72-{rack_index:03d}",
                    gpu_uids=[
                        f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'gpucloud-sim/{node_id}/{g}')}" for g in range(gpus)
                    ],
                )

    def inventory(self, base_url: str) -> list[dict]:
        return [
            {
                "id": n.id,
                "hostname": n.hostname,
                "region": n.region,
                "pod": n.pod,
                "rack": n.rack,
                "leaf_switch": n.leaf_switch,
                "pdu": n.pdu,
                "gpu_type": n.gpu_type,
                "gpu_count": n.gpu_count,
                "ib_port_guids": n.ib_port_guids,
                "nvlink_domain": n.nvlink_domain,
                "gpu_uids": n.gpu_uids,
                "agent_url": f"{base_url}/v1/nodes/{n.id}",
                **(self.bmc_fields(n.id) if self.bmc_fields is not None else {}),
                **self._ssh_fields(n.id),
            }
            for n in self.nodes.values()
        ]

    async def start_ssh(self) -> None:
        """Every node's SSH endpoint on a loopback port of its own (`spec.ssh`); before the
        inventory is read, which names each node's port."""
        if self.spec.ssh and self.ssh is None:
            self.ssh = FleetSsh(user=self.spec.ssh_user, host=LOOPBACK)
            await self.ssh.start(self.nodes.values())

    def _ssh_fields(self, node_id: str) -> dict:
        """The node's SSH endpoint as enrollment records it (the address the network gave it)."""
        port = self.ssh.port(node_id) if self.ssh is not None else None
        return {"ssh_host": self.ssh.host, "ssh_port": port} if self.ssh is not None and port else {}

    def behind_switch(self, switch_id: str) -> list[SimNode]:
        """The nodes whose fabric ports hang off the leaf switch (404 if none do)."""
        nodes = [n for n in self.nodes.values() if n.leaf_switch == switch_id]
        if not nodes:
            raise HTTPException(404, f"no simulated node behind leaf switch {switch_id!r}")
        return nodes

    def node(self, node_id: str) -> SimNode:
        node = self.nodes.get(node_id)
        if node is None:
            raise HTTPException(404, f"no simulated node {node_id!r}")
        return node

    async def act(self, node: SimNode, action: AgentAction, req: ActionRequest) -> Outcome:
        """The node's agent answers, as the production agent does (its action core), unless the
        node has no agent that answers (powered off, or cut off by a test)."""
        if node.unreachable:
            return problem(503, "Agent unreachable", f"agent on {node.id} does not answer")
        core = ActionCore(node, SimulatedHardware(self, node), remembered=REMEMBERED_REQUESTS)
        return await core.act(action, req)

    def latency_s(self, action: AgentAction) -> float:
        if action == A.PROVISION and self.spec.provision_s is not None:
            return self.spec.provision_s
        if action == A.DIAGNOSE and self.spec.diagnose_s is not None:
            return self.spec.diagnose_s
        return BASE_LATENCY_S[action] * self.spec.latency_scale * self.rng.uniform(0.7, 1.3)

    @staticmethod
    def _repair(node: SimNode, action: AgentAction) -> None:
        if action in (A.REBOOT, A.REFLASH):
            node.boot_id += 1
            node.workload_running = False
        if action == A.REFLASH:
            node.tenant_id = None
        if node.fault_fixed_by is not None and REPAIR_LADDER.index(action) >= REPAIR_LADDER.index(node.fault_fixed_by):
            node.hardware_fault = node.fault_fixed_by = None

    async def workload_changed(self, node: SimNode) -> None:
        if self.on_workload_change is not None:
            await self.on_workload_change(node)

    def drift(self, node: SimNode, kind: str) -> None:
        """What happens to hardware behind the control plane's back: a reboot (`AgentAction.REBOOT`)
        kills the workload, a wipe (say, a re-imaged disk) also loses the tenant's data, and
        `replace_agent` puts a stand-in there that lies about the image it booted."""
        if kind == "replace_agent":
            node.stand_in = True
            return
        node.boot_id += 1
        node.workload_running = False
        if kind == A.WIPE:
            node.tenant_id = None
            node.ssh_keys = ()

    def heartbeats(self) -> list[Heartbeat]:
        return [
            Heartbeat(
                node_id=n.id,
                tenant_id=n.tenant_id,
                workload_running=n.workload_running,
                boot_id=str(n.boot_id),
                workload=self.workload_status(n),
            )
            for n in self.nodes.values()
            if not n.unreachable
        ]

    def workload_status(self, node: SimNode) -> WorkloadStatus | None:
        """What the node's agent reports of its workload: running, or exited with its status."""
        if node.workload is None:
            return None
        if node.workload_run is None:
            return WorkloadStatus(state="running", allocation_id=node.allocation_id)
        state, code = node.workload_run.status(self.clock() - node.workload_started_s)
        return WorkloadStatus(state=state, allocation_id=node.allocation_id, exit_code=code, isolation="simulated")

    @staticmethod
    def describe(node: SimNode) -> dict:
        return {
            "node_id": node.id,
            "gpu_type": node.gpu_type,
            "gpu_count": node.gpu_count,
            "tenant_id": node.tenant_id,
            "workload_running": node.workload_running,
            "workload": node.workload,
            "ssh_keys": list(node.ssh_keys),
            "actions_done": node.actions_done,
            "hardware_fault": node.hardware_fault,
            "links_down": node.links_down,
        }


class SimulatedHardware:
    """A simulated node's hardware behind the action core's `NodeHardware`, in memory and without a
    thread: each action takes its (scaled) time; an injected fault fails it (transient: 503, which
    the core does not remember, so a retry runs it; permanent: 422); burn-in finds the node's
    hardware fault until the repair rung that fixes it has run; a reboot or reflash boots anew
    (a reflash also loses the tenant's data); a wipe's cleaning is answered step by step as the
    real agent answers it; a provision's workload is never run,
    its output and end synthesized from its command (`sim/workload_output.py`); each change of the workload
    reaches the fleet's `on_workload_change` (metering). A stand-in agent reports the image it
    claims, not the one it booted."""

    __slots__ = ("fleet", "node")

    def __init__(self, fleet: Fleet, node: SimNode) -> None:
        self.fleet, self.node = fleet, node

    async def run_tools(self, action: AgentAction) -> Outcome | None:
        node = self.node
        await asyncio.sleep(self.fleet.latency_s(action))
        pending = node.faults.get(action)
        if pending:
            if pending.popleft() == "transient":
                return problem(503, ACTION_FAILED, f"injected transient fault in {action}")
            return action_failed(f"injected permanent fault in {action}")
        if action == A.BURN_IN and node.hardware_fault is not None:
            return action_failed(f"burn-in failed: {node.hardware_fault}")
        if action in REPAIR_LADDER:
            Fleet._repair(node, action)
        elif action == A.WIPE:
            # A wipe resets every GPU (`_cleaning`): what a reset settles (a row remap pending,
            # a contained ECC error) is gone after it, as on a real node.
            Fleet._repair(node, A.RESET)
        return None

    async def start_workload(self, req: ActionRequest) -> Outcome | None:
        node = self.node
        same = node.workload_run is not None and node.allocation_id == req.allocation_id
        node.allocation_id = req.allocation_id
        node.workload = list(req.workload.command) if req.workload else None
        if req.workload is None:
            node.workload_run = None
        elif not same:  # as the real agent: the workload already running for it is kept
            node.workload_run = simulate(req.workload, allocation_id=req.allocation_id)
            node.workload_started_s = self.fleet.clock()
        return None

    async def stop_workload(self) -> Outcome | None:
        self.node.workload = None
        self.node.workload_run = None
        return None

    async def install_ssh_keys(self, keys: Sequence[str]) -> Outcome | None:
        self.node.ssh_keys = tuple(keys)
        return None

    async def remove_ssh_keys(self) -> Outcome | None:
        """No key of the tenant opens the node any more, and its open sessions end."""
        self.node.ssh_keys = ()
        if self.fleet.ssh is not None:
            self.fleet.ssh.disconnect(self.node.id)
        return None

    async def clean(self) -> tuple[list[CleaningStep], CleaningFailed | None]:
        return _cleaning(self.node), None

    def take_credential(self, credential: str) -> None:
        self.node.credential, self.node.credential_from = credential, "in_band"

    async def diagnose(self) -> Diagnosis:
        """The scheduled diagnostics from the node's fault model: a hardware fault (latent on an
        idle node until something tests it) fails `dcgmi diag`, as burn-in finds it; a healthy
        node passes every tool."""
        fault = self.node.hardware_fault
        if fault is None:
            return Diagnosis(checks=[DiagnosticCheck(tool=t, status="pass") for t in _DIAGNOSE_TOOLS])
        why = f"dcgmi diag failed: {fault}"
        return Diagnosis(
            checks=[
                DiagnosticCheck(tool="dcgmi", status="fail", detail=why),
                *(DiagnosticCheck(tool=t, status="pass") for t in _DIAGNOSE_TOOLS[1:]),
            ],
            observations=[SignalObservation(signal=Signal.DIAG_FAILURE, at=utc_now(), source="dcgmi", detail=why)],
        )

    async def settle(self, action: AgentAction, req: ActionRequest, *, started_ms: int) -> NodeFacts:
        node = self.node
        node.actions_done += 1
        await self.fleet.workload_changed(node)
        return NodeFacts(
            node_id=node.id,
            boot_id=str(node.boot_id),
            image_digest=STAND_IN_DIGEST if node.stand_in else node.image_digest,
            gpu_count=node.gpu_count,
        )


_DIAGNOSE_TOOLS = ("dcgmi", "all_reduce_perf", "nvbandwidth")


def _cleaning(node: SimNode) -> list[CleaningStep]:
    """A wipe's steps as the real agent answers them (`agent/cleaning.py`), on simulated hardware:
    every GPU reset, each tenant disk crypto-erased, the tenant's files removed."""
    return [
        CleaningStep(
            step=GPU_RESET, target="every GPU", method="gpu_reset", ok=True, answer=f"{node.gpu_count} GPUs reset"
        ),
        *(
            CleaningStep(
                step=DISK_SANITIZE,
                target=disk,
                method="crypto_erase",
                ok=True,
                answer=f"nvme format {disk} --ses=2 --force: Success formatting namespace:1",
            )
            for disk in node.tenant_disks
        ),
        CleaningStep(
            step=SCRATCH,
            target="/var/lib/gpucloud/scratch",
            method="remove",
            ok=True,
            answer="removed the tenant's files, weights and workload output",
        ),
    ]


def _port_guids(spec: FleetSpec, index: int, ports: int) -> list[str]:
    return [f"0x{spec.seed & 0xFFFF:04x}{index:06x}{port:06x}" for port in range(ports)]
