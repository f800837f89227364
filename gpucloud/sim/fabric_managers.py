"""Simulated fabric managers: UFM (InfiniBand pkeys), NMX-M (NVLink partitions) and an SDN
controller (Ethernet VPCs) as one FastAPI app, one router per manager, served on loopback.

They enforce the constraints the real managers (and the isolation promise) rely on, and refuse
a request that would break one with a 4xx whose body names it:
``{"detail": {"constraint": "<name>", "message": "<what and why>"}}``.

UFM (`/ufmRest/resources/pkeys`): a new pkey lies in 0x0001-0x7ffe (`pkey_range`) and is not
taken (`pkey_unique`); the default partition 0x7fff holds ports only as limited members
(`default_partition_limited`) and cannot be deleted (`default_partition_permanent`); a port
GUID is a full member of at most one non-default pkey (`full_member_single_pkey`).
NMX-M (`/nmx/v1`): a partition holds GPUs of its own NVL72 domain only (`gpu_in_domain`), and a
GPU is in at most one partition (`gpu_single_partition`); names are unique in a domain
(`partition_name_unique`).
The domains' GPUs are registered with `PUT /nmx/v1/domains/{id}` (real NMX-M discovers them).
SDN (`/sdn/v1/vpcs`): a VNI lies in 1-2^24-1 (`vni_range`) and belongs to one tenant
(`vni_unique`), a tenant has one VNI (`one_vni_per_tenant`), a node is attached to one VPC
(`node_single_vpc`), and only an empty VPC is deleted (`vpc_not_empty`).

State lives in memory, and with a `state_path` also in a JSON file rewritten after every change
(so a second `gpucloud up` on the same data dir finds the partitions the first one made).
Handlers are `async` but never await, so each runs whole on the event loop (no thread-pool hop
per request); the lock keeps a handler safe should it move to the pool.

Faults for tests (`PUT /sim/v1/fault`): `unavailable` answers every manager request with 503 (a
manager down); `stale_reads` answers single-record reads with the record's members left out (a
manager whose reads disagree with what it acknowledged), which a read-back must catch.

`FabricManagersServer` runs the app on a daemon thread for tests; `main` runs it standalone
(`gpucloud fabric-managers`, which `gpucloud up` starts).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, NoReturn

import httpx
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from gpucloud.devstack.serving import ThreadedServer
from gpucloud.fabric.http_clients import NmxClient
from gpucloud.fabric.interface import (
    DEFAULT_PKEY,
    MAX_PKEY,
    MAX_VNI,
    MIN_PKEY,
    MIN_VNI,
    Membership,
    NvlPartition,
    PKey,
    PortMember,
    Vpc,
)

GUID = re.compile(r"^0x[0-9a-f]{16}$")


def refuse(status_code: int, constraint: str, message: str) -> NoReturn:
    raise HTTPException(status_code, detail={"constraint": constraint, "message": message})


def parse_pkey(text: str) -> int:
    try:
        return int(text, 16)
    except ValueError:
        refuse(422, "pkey_format", f"pkey {text!r} is not a hex number like 0x0a12")


def pkey_hex(pkey: int) -> str:
    return f"0x{pkey:04x}"


@dataclass
class FabricState:
    """What the three managers hold; every access goes through `lock`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    pkeys: dict[int, dict[str, Membership]] = field(default_factory=lambda: {DEFAULT_PKEY: {}})
    pkey_names: dict[int, str] = field(default_factory=lambda: {DEFAULT_PKEY: "default"})
    domain_of_gpu: dict[str, str] = field(default_factory=dict)
    partitions: dict[int, NvlPartition] = field(default_factory=dict)
    next_partition_id: int = 1
    vpcs: dict[int, Vpc] = field(default_factory=dict)
    fault: str | None = None
    state_path: Path | None = None

    def pkey_record(self, pkey: int) -> PKey:
        members = tuple(PortMember(guid=g, membership=m) for g, m in sorted(self.pkeys[pkey].items()))
        return PKey(pkey=pkey, name=self.pkey_names[pkey], members=members)

    def saved(self) -> None:
        """Write the state to `state_path` (when there is one); call with `lock` held, after a change."""
        if self.state_path is None:
            return
        body = {
            "pkeys": [self.pkey_record(p).model_dump(mode="json") for p in sorted(self.pkeys)],
            "domain_of_gpu": self.domain_of_gpu,
            "partitions": [p.model_dump(mode="json") for p in self.partitions.values()],
            "next_partition_id": self.next_partition_id,
            "vpcs": [v.model_dump(mode="json") for v in self.vpcs.values()],
        }
        partial = self.state_path.with_suffix(".partial")
        partial.write_text(json.dumps(body))
        os.replace(partial, self.state_path)

    @classmethod
    def load(cls, state_path: Path | None) -> FabricState:
        state = cls(state_path=state_path)
        if state_path is None or not state_path.exists():
            return state
        body = json.loads(state_path.read_text())
        for record in map(PKey.model_validate, body["pkeys"]):
            state.pkeys[record.pkey] = {m.guid: m.membership for m in record.members}
            state.pkey_names[record.pkey] = record.name
        state.domain_of_gpu = body["domain_of_gpu"]
        state.partitions = {p.partition_id: p for p in map(NvlPartition.model_validate, body["partitions"])}
        state.next_partition_id = body["next_partition_id"]
        state.vpcs = {v.vni: v for v in map(Vpc.model_validate, body["vpcs"])}
        return state


def _state(request: Request) -> FabricState:
    return request.app.state.fabric


StateDep = Annotated[FabricState, Depends(_state)]


async def _available(state: StateDep) -> None:
    if state.fault == "unavailable":
        raise HTTPException(503, detail="injected fault: the manager is unavailable")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- UFM -------------------------------------------------------------------------------------


class PKeyCreate(_Body):
    pkey: str
    name: str = ""


class PKeyGuids(_Body):
    pkey: str
    guids: list[str] = Field(min_length=1)
    membership: Membership = Membership.FULL


class UfmPKey(_Body):
    pkey: str
    name: str
    guids: list[PortMember]


def _ufm(record: PKey) -> UfmPKey:
    return UfmPKey(pkey=pkey_hex(record.pkey), name=record.name, guids=list(record.members))


def _existing_pkey(state: FabricState, pkey: int) -> None:
    if pkey not in state.pkeys:
        refuse(404, "pkey_exists", f"pkey {pkey_hex(pkey)} does not exist")


def _check_guids(guids: Iterable[str]) -> list[str]:
    normalized = [g.lower() for g in guids]
    for guid in normalized:
        if not GUID.match(guid):
            refuse(422, "guid_format", f"port GUID {guid!r} is not 0x followed by 16 hex digits")
    return normalized


def _check_full_membership(state: FabricState, pkey: int, guids: list[str]) -> None:
    if pkey == DEFAULT_PKEY:
        refuse(
            409,
            "default_partition_limited",
            f"the default partition {pkey_hex(DEFAULT_PKEY)} holds ports as limited members only",
        )
    for guid in guids:
        for other, members in state.pkeys.items():
            if other not in (pkey, DEFAULT_PKEY) and members.get(guid) == Membership.FULL:
                refuse(
                    409,
                    "full_member_single_pkey",
                    f"port {guid} is already a full member of pkey {pkey_hex(other)}; "
                    "a port is a full member of at most one non-default pkey",
                )


ufm = APIRouter(prefix="/ufmRest/resources/pkeys", tags=["ufm"])


@ufm.post("/add", status_code=201, response_model=UfmPKey)
async def create_pkey(body: PKeyCreate, state: StateDep) -> UfmPKey:
    pkey = parse_pkey(body.pkey)
    if not MIN_PKEY <= pkey <= MAX_PKEY:
        refuse(
            422,
            "pkey_range",
            f"pkey {pkey_hex(pkey)} is outside {pkey_hex(MIN_PKEY)}-{pkey_hex(MAX_PKEY)}",
        )
    with state.lock:
        if pkey in state.pkeys:
            refuse(409, "pkey_unique", f"pkey {pkey_hex(pkey)} already exists")
        state.pkeys[pkey] = {}
        state.pkey_names[pkey] = body.name
        state.saved()
        return _ufm(state.pkey_record(pkey))


@ufm.post("", response_model=UfmPKey)
async def add_guids(body: PKeyGuids, state: StateDep) -> UfmPKey:
    pkey = parse_pkey(body.pkey)
    guids = _check_guids(body.guids)
    with state.lock:
        _existing_pkey(state, pkey)
        if body.membership == Membership.FULL:
            _check_full_membership(state, pkey, guids)
        for guid in guids:
            state.pkeys[pkey][guid] = body.membership
        state.saved()
        return _ufm(state.pkey_record(pkey))


@ufm.get("", response_model=dict[str, UfmPKey])
async def list_pkeys(state: StateDep) -> dict[str, UfmPKey]:
    with state.lock:
        return {pkey_hex(p): _ufm(state.pkey_record(p)) for p in sorted(state.pkeys)}


@ufm.get("/{pkey}", response_model=UfmPKey)
async def get_pkey(pkey: str, state: StateDep) -> UfmPKey:
    number = parse_pkey(pkey)
    with state.lock:
        _existing_pkey(state, number)
        record = state.pkey_record(number)
        return _ufm(record.model_copy(update={"members": ()}) if state.fault == "stale_reads" else record)


@ufm.delete("/{pkey}/guids/{guids}", response_model=UfmPKey)
async def remove_guids(pkey: str, guids: str, state: StateDep) -> UfmPKey:
    number = parse_pkey(pkey)
    removed = _check_guids(guids.split(","))
    with state.lock:
        _existing_pkey(state, number)
        for guid in removed:
            state.pkeys[number].pop(guid, None)
        state.saved()
        return _ufm(state.pkey_record(number))


@ufm.delete("/{pkey}", status_code=204)
async def delete_pkey(pkey: str, state: StateDep) -> None:
    number = parse_pkey(pkey)
    if number == DEFAULT_PKEY:
        refuse(409, "default_partition_permanent", "the default partition cannot be deleted")
    with state.lock:
        _existing_pkey(state, number)
        del state.pkeys[number]
        del state.pkey_names[number]
        state.saved()


# --- NMX-M -----------------------------------------------------------------------------------


class DomainGpus(_Body):
    gpu_uids: list[str]


class PartitionCreate(_Body):
    name: str = Field(min_length=1)
    domain_id: str
    gpu_uids: list[str] = Field(min_length=1)


class PartitionUpdate(_Body):
    gpu_uids: list[str] = Field(min_length=1)


nmx = APIRouter(prefix="/nmx/v1", tags=["nmx"])


@nmx.put("/domains/{domain_id}", status_code=204)
async def register_domain(domain_id: str, body: DomainGpus, state: StateDep) -> None:
    with state.lock:
        for gpu in body.gpu_uids:
            if state.domain_of_gpu.get(gpu, domain_id) != domain_id:
                refuse(409, "gpu_single_domain", f"GPU {gpu} is in domain {state.domain_of_gpu[gpu]}")
        for gpu in body.gpu_uids:
            state.domain_of_gpu[gpu] = domain_id
        state.saved()


def _check_gpus(state: FabricState, domain_id: str, gpu_uids: list[str], *, partition_id: int | None = None) -> None:
    """The GPUs may form partition `partition_id` (None: a new one) of `domain_id`."""
    if len(set(gpu_uids)) != len(gpu_uids):
        refuse(422, "gpu_listed_once", "a GPU is listed more than once")
    for gpu in gpu_uids:
        if state.domain_of_gpu.get(gpu) != domain_id:
            refuse(
                409,
                "gpu_in_domain",
                f"GPU {gpu} is not in NVL72 domain {domain_id}; a partition spans one domain",
            )
        for other in state.partitions.values():
            if other.partition_id != partition_id and gpu in other.gpu_uids:
                refuse(
                    409,
                    "gpu_single_partition",
                    f"GPU {gpu} is already in partition {other.partition_id} ({other.name}); "
                    "a GPU is in at most one partition",
                )


def _check_partition(state: FabricState, body: PartitionCreate) -> None:
    if body.domain_id not in state.domain_of_gpu.values():
        refuse(404, "domain_exists", f"NVL72 domain {body.domain_id} is not known")
    if any(p.name == body.name and p.domain_id == body.domain_id for p in state.partitions.values()):
        refuse(
            409,
            "partition_name_unique",
            f"domain {body.domain_id} already has a partition named {body.name!r}",
        )
    _check_gpus(state, body.domain_id, body.gpu_uids)


@nmx.post("/partitions", status_code=201, response_model=NvlPartition)
async def create_partition(body: PartitionCreate, state: StateDep) -> NvlPartition:
    with state.lock:
        _check_partition(state, body)
        partition = NvlPartition(
            partition_id=state.next_partition_id,
            name=body.name,
            domain_id=body.domain_id,
            gpu_uids=tuple(body.gpu_uids),
        )
        state.partitions[partition.partition_id] = partition
        state.next_partition_id += 1
        state.saved()
        return partition


@nmx.get("/partitions", response_model=list[NvlPartition])
async def list_partitions(state: StateDep, domain_id: str | None = None) -> list[NvlPartition]:
    with state.lock:
        return [p for p in state.partitions.values() if domain_id in (None, p.domain_id)]


def _partition(state: FabricState, partition_id: int) -> NvlPartition:
    if partition_id not in state.partitions:
        refuse(404, "partition_exists", f"partition {partition_id} does not exist")
    return state.partitions[partition_id]


@nmx.get("/partitions/{partition_id}", response_model=NvlPartition)
async def get_partition(partition_id: int, state: StateDep) -> NvlPartition:
    with state.lock:
        partition = _partition(state, partition_id)
        return partition.model_copy(update={"gpu_uids": ()}) if state.fault == "stale_reads" else partition


@nmx.put("/partitions/{partition_id}", response_model=NvlPartition)
async def update_partition(partition_id: int, body: PartitionUpdate, state: StateDep) -> NvlPartition:
    """Replace the partition's GPUs; the same rules hold as at creation."""
    with state.lock:
        partition = _partition(state, partition_id)
        _check_gpus(state, partition.domain_id, body.gpu_uids, partition_id=partition_id)
        partition = state.partitions[partition_id] = partition.model_copy(update={"gpu_uids": tuple(body.gpu_uids)})
        state.saved()
        return partition


@nmx.delete("/partitions/{partition_id}", status_code=204)
async def delete_partition(partition_id: int, state: StateDep) -> None:
    with state.lock:
        _partition(state, partition_id)
        del state.partitions[partition_id]
        state.saved()


# --- SDN controller --------------------------------------------------------------------------


class VpcCreate(_Body):
    tenant_id: str = Field(min_length=1)
    vni: int | None = Field(default=None, description="omitted: the controller picks a free VNI")


sdn = APIRouter(prefix="/sdn/v1/vpcs", tags=["sdn"])


def _free_vni(state: FabricState) -> int:
    return next(v for v in range(MIN_VNI, MAX_VNI + 1) if v not in state.vpcs)


@sdn.post("", status_code=201, response_model=Vpc)
async def create_vpc(body: VpcCreate, state: StateDep) -> Vpc:
    if body.vni is not None and not MIN_VNI <= body.vni <= MAX_VNI:
        refuse(422, "vni_range", f"VNI {body.vni} is outside {MIN_VNI}-{MAX_VNI}")
    with state.lock:
        owned = [v for v in state.vpcs.values() if v.tenant_id == body.tenant_id]
        if owned:
            refuse(
                409,
                "one_vni_per_tenant",
                f"tenant {body.tenant_id} already has VNI {owned[0].vni}; a tenant has one VPC",
            )
        vni = _free_vni(state) if body.vni is None else body.vni
        if vni in state.vpcs:
            refuse(409, "vni_unique", f"VNI {vni} belongs to another tenant")
        state.vpcs[vni] = Vpc(vni=vni, tenant_id=body.tenant_id)
        state.saved()
        return state.vpcs[vni]


@sdn.get("", response_model=list[Vpc])
async def list_vpcs(state: StateDep, tenant_id: Annotated[str | None, Query()] = None) -> list[Vpc]:
    with state.lock:
        return [v for v in state.vpcs.values() if tenant_id in (None, v.tenant_id)]


def _vpc(state: FabricState, vni: int) -> Vpc:
    if vni not in state.vpcs:
        refuse(404, "vpc_exists", f"no VPC has VNI {vni}")
    return state.vpcs[vni]


@sdn.get("/{vni}", response_model=Vpc)
async def get_vpc(vni: int, state: StateDep) -> Vpc:
    with state.lock:
        vpc = _vpc(state, vni)
        return vpc.model_copy(update={"nodes": ()}) if state.fault == "stale_reads" else vpc


@sdn.put("/{vni}/nodes/{node_id}", response_model=Vpc)
async def attach_node(vni: int, node_id: str, state: StateDep) -> Vpc:
    with state.lock:
        vpc = _vpc(state, vni)
        for other in state.vpcs.values():
            if other.vni != vni and node_id in other.nodes:
                refuse(
                    409,
                    "node_single_vpc",
                    f"node {node_id} is attached to VNI {other.vni}; a node is in one VPC",
                )
        if node_id not in vpc.nodes:
            vpc = state.vpcs[vni] = vpc.model_copy(update={"nodes": (*vpc.nodes, node_id)})
            state.saved()
        return vpc


@sdn.delete("/{vni}/nodes/{node_id}", response_model=Vpc)
async def detach_node(vni: int, node_id: str, state: StateDep) -> Vpc:
    with state.lock:
        vpc = _vpc(state, vni)
        nodes = tuple(n for n in vpc.nodes if n != node_id)
        state.vpcs[vni] = vpc.model_copy(update={"nodes": nodes})
        state.saved()
        return state.vpcs[vni]


@sdn.delete("/{vni}", status_code=204)
async def delete_vpc(vni: int, state: StateDep) -> None:
    with state.lock:
        vpc = _vpc(state, vni)
        if vpc.nodes:
            refuse(409, "vpc_not_empty", f"VNI {vni} still has nodes attached: {', '.join(vpc.nodes)}")
        del state.vpcs[vni]
        state.saved()


# --- test faults ------------------------------------------------------------------------------


class FaultSetting(_Body):
    mode: Literal["unavailable", "stale_reads"] | None = Field(description="None: no fault")


faults = APIRouter(prefix="/sim/v1", tags=["simulator"])


@faults.put("/fault", response_model=FaultSetting)
async def set_fault(body: FaultSetting, state: StateDep) -> FaultSetting:
    with state.lock:
        state.fault = body.mode
    return body


def create_app(*, nvl_domains: dict[str, list[str]] | None = None, state_path: Path | None = None) -> FastAPI:
    """The three managers; `nvl_domains` maps each NVL72 domain to its GPUs' UIDs; with a
    `state_path` the state survives a restart."""
    app = FastAPI(title="Simulated fabric managers (UFM, NMX-M, SDN)")
    app.state.fabric = state = FabricState.load(state_path)
    for domain, gpus in (nvl_domains or {}).items():
        for gpu in gpus:
            state.domain_of_gpu[gpu] = domain

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    for router in (ufm, nmx, sdn):
        app.include_router(router, dependencies=[Depends(_available)])
    app.include_router(faults)
    return app


def nvl_domains(inventory: Iterable[dict]) -> dict[str, list[str]]:
    """NVL72 domain -> its GPUs' UIDs, from a fleet inventory (`/v1/inventory` of the simulated fleet)."""
    domains: dict[str, list[str]] = {}
    for node in inventory:
        if node.get("nvlink_domain") and node.get("gpu_uids"):
            domains.setdefault(node["nvlink_domain"], []).extend(node["gpu_uids"])
    return domains


def register_nvl_domains(url: str, inventory: Iterable[dict]) -> int:
    """Tell the simulated NMX-M which GPUs each NVL72 domain has (real NMX-M discovers them);
    idempotent. Returns the number of domains."""
    domains = nvl_domains(inventory)
    with httpx.Client(timeout=30) as client:
        nmx = NmxClient(client, url)
        for domain, gpus in domains.items():
            nmx.register_domain(domain, gpus)
    return len(domains)


class FabricManagersServer(ThreadedServer):
    """The simulated managers served on a daemon thread; `start` returns the URL."""

    def __init__(self, app: FastAPI, *, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(app, host=host, port=port, name="fabric-managers")


def main(host: str = "127.0.0.1", port: int = 8470, *, state_path: Path | None = None) -> None:
    uvicorn.run(create_app(state_path=state_path), host=host, port=port, log_level="warning", access_log=False)
