"""Simulated SDN controller (`/sdn/v1/vpcs`): one Ethernet VPC (VNI) per tenant."""

from __future__ import annotations

from functools import partial
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import Field

from gpucloud.fabric.interface import (
    MAX_VNI,
    MIN_VNI,
    Vpc,
)
from gpucloud.sim.fabric_managers.state import Body, FabricState, StateDep, existing, refuse


class VpcCreate(Body):
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


def _vpc(state: FabricState, vni: int) -> Vpc:
    return existing(state.vpcs, vni, "vpc_exists", f"no VPC has VNI {vni}")


@sdn.get("/{vni}", response_model=Vpc)
async def get_vpc(vni: int, state: StateDep) -> Vpc:
    return state.read(partial(_vpc, state, vni), "nodes")


@sdn.get("", response_model=list[Vpc])
async def list_vpcs(state: StateDep, tenant_id: Annotated[str | None, Query()] = None) -> list[Vpc]:
    with state.lock:
        return [v for v in state.vpcs.values() if tenant_id in (None, v.tenant_id)]


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
        if node_id in vpc.nodes:
            nodes = tuple(n for n in vpc.nodes if n != node_id)
            vpc = state.vpcs[vni] = vpc.model_copy(update={"nodes": nodes})
            state.saved()
        return vpc


@sdn.delete("/{vni}", status_code=204)
async def delete_vpc(vni: int, state: StateDep) -> None:
    with state.lock:
        vpc = _vpc(state, vni)
        if vpc.nodes:
            refuse(409, "vpc_not_empty", f"VNI {vni} still has nodes attached: {', '.join(vpc.nodes)}")
        del state.vpcs[vni]
        state.saved()
