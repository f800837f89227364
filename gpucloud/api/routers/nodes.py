"""Nodes (operator only): enrollment by the fleet, listing and reading."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field
from sqlmodel import select

from gpucloud.api import pagination
from gpucloud.api.deps import OperatorDep, SessionDep, SettingsDep, TemporalDep
from gpucloud.api.problems import not_found
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import Node, NodeEnroll, NodePublic
from gpucloud.services.nodes import enroll_nodes
from gpucloud.services.workflows import start_bringup

router = APIRouter(prefix="/v1", tags=["nodes"])

MAX_ENROLL_BATCH = 1000


class EnrollRequest(BaseModel):
    nodes: list[NodeEnroll] = Field(min_length=1, max_length=MAX_ENROLL_BATCH)


class EnrollResult(BaseModel):
    enrolled: int
    already_known: int
    bringups_started: int


class NodePage(BaseModel):
    items: list[NodePublic]
    next_page_token: str


def _enroll(settings: Settings, req: EnrollRequest) -> tuple[list[str], int, int]:
    with session_scope(settings.db_url) as session:
        new, known = enroll_nodes(session, req.nodes)
        # A known node still `enrolled` lost its bring-up (crash): start it again.
        pending = session.exec(select(Node.id).where(Node.id.in_(known), Node.state == NodeState.ENROLLED)).all()
        return [*new, *pending], len(new), len(known)


@router.post("/nodes:enroll", response_model=EnrollResult)
async def enroll(req: EnrollRequest, operator: OperatorDep, settings: SettingsDep, temporal: TemporalDep):
    to_start, new, known = await run_in_threadpool(_enroll, settings, req)
    for node_id in to_start:
        await start_bringup(temporal, settings, node_id)
    return EnrollResult(enrolled=new, already_known=known, bringups_started=len(to_start))


@router.get("/nodes", response_model=NodePage)
def list_nodes(
    operator: OperatorDep, session: SessionDep,
    page_size: Annotated[int, Query(ge=1, le=pagination.MAX_PAGE_SIZE)] = pagination.DEFAULT_PAGE_SIZE,
    page_token: str | None = None, state: NodeState | None = None, gpu_type: str | None = None,
    region: str | None = None,
):
    filters = {"state": state, "gpu_type": gpu_type, "region": region}
    cursor = pagination.decode(page_token, filters)
    query = select(Node).order_by(Node.id).limit(page_size + 1)
    if state is not None:
        query = query.where(Node.state == state)
    if gpu_type is not None:
        query = query.where(Node.gpu_type == gpu_type)
    if region is not None:
        query = query.where(Node.region == region)
    if cursor.after is not None:
        query = query.where(Node.id > cursor.after)
    rows, token = pagination.page(list(session.exec(query).all()), page_size, lambda n: n.id, filters)
    return NodePage(items=[NodePublic.model_validate(n, from_attributes=True) for n in rows], next_page_token=token)


@router.get("/nodes/{node_id}", response_model=NodePublic)
def get_node(node_id: str, operator: OperatorDep, session: SessionDep):
    node = session.get(Node, node_id)
    if node is None:
        raise not_found("node", node_id)
    return NodePublic.model_validate(node, from_attributes=True)
