"""Simulated NMX-M (`/nmx/v1`): NVLink partitions inside NVL72 domains."""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter
from pydantic import Field

from gpucloud.fabric.interface import (
    NvlPartition,
)
from gpucloud.sim.fabric_managers.state import Body, FabricState, StateDep, existing, refuse


class DomainGpus(Body):
    gpu_uids: list[str]


class PartitionCreate(Body):
    name: str = Field(min_length=1)
    domain_id: str
    gpu_uids: list[str] = Field(min_length=1)


class PartitionUpdate(Body):
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
    return existing(state.partitions, partition_id, "partition_exists", f"partition {partition_id} does not exist")


@nmx.get("/partitions/{partition_id}", response_model=NvlPartition)
async def get_partition(partition_id: int, state: StateDep) -> NvlPartition:
    return state.read(partial(_partition, state, partition_id), "gpu_uids")


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
