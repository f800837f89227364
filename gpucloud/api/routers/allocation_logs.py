"""`GET /v1/allocations/{id}/nodes/{node}/logs`: what the workload on one node of a tenant's
allocation printed, read from the node's agent (`protocol/logs.py`) through the control plane's
agent client (`adapters/host_agent.py`), with a token that reads that node's output and nothing
else (`log-reader`, minted by this API's delegate).

The text is the tenant's (it has root on the node, and its program wrote it): handed over as
`text/plain` (UTF-8, bytes that are not replaced), never parsed, bounded by the agent's tail and
by this route's own follow bounds (`MAX_FOLLOW_S`, `MAX_FOLLOW_BYTES`). A follow holds one of the
caller's admission slots while it lasts (`api/admission.py`), so a tenant's follows cost only its
own share. Operators read it with the `fleet` scope (those who run the nodes), not `read`: it is
the tenant's program's text, secrets it printed included.
"""

from __future__ import annotations

import codecs
import logging
from collections.abc import AsyncIterator
from typing import Annotated

import httpx
from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from gpucloud.adapters.host_agent import HttpHostAgents
from gpucloud.api.deps import CallerOrFleetOperatorDep, ReadsDep, visible
from gpucloud.models.tables import Allocation
from gpucloud.protocol.logs import DEFAULT_FOLLOW_S, MAX_FOLLOW_BYTES, MAX_FOLLOW_S, MAX_TAIL_LINES, LogsQuery
from gpucloud.services.node_access import node_in
from gpucloud.web.problems import Problem

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["allocations"])
TEXT = "text/plain; charset=utf-8"


def _node_of(reads, caller, allocation_id: str, node_id: str) -> tuple[str, str]:
    """The node's id and agent URL, when it is a node of an allocation the caller sees."""
    with reads() as session:
        node = node_in(session, visible(session, caller, Allocation, "allocation", allocation_id), node_id)
        return node.id, node.agent_url


@router.get(
    "/allocations/{allocation_id}/nodes/{node_id}/logs",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/plain": {}}, "description": "the workload's stdout and stderr, as written"},
        404: {"description": "no such allocation or node visible to the caller, or no workload on the node"},
        503: {"description": "the node's agent did not answer"},
    },
)
async def allocation_node_logs(
    request: Request,
    allocation_id: str,
    node_id: str,
    caller: CallerOrFleetOperatorDep,
    reads: ReadsDep,
    tail: Annotated[int | None, Query(ge=0, le=MAX_TAIL_LINES, description="only the last N lines")] = None,
    follow: Annotated[bool, Query(description="keep streaming until the workload exits")] = False,
    follow_s: Annotated[
        float, Query(gt=0, le=MAX_FOLLOW_S, description="with follow: stop after this many seconds at most")
    ] = DEFAULT_FOLLOW_S,
) -> StreamingResponse:
    node, agent_url = await run_in_threadpool(_node_of, reads, caller, allocation_id, node_id)
    agents: HttpHostAgents | None = getattr(request.app.state, "agent_logs", None)
    if agents is None:
        raise Problem(
            503,
            "unavailable",
            "Logs unavailable",
            "this API holds no delegate to read nodes' output with: issue one (`gpucloud issue-delegate`)",
        )
    query = LogsQuery(tail=tail, follow=follow, follow_s=follow_s)
    try:
        response = await agents.open_logs(agent_url, node_id=node, params=query.params(), timeout_s=follow_s + 30)
    except httpx.HTTPError as exc:
        raise Problem(503, "agent-unreachable", "Agent unreachable", f"the agent of {node} did not answer") from exc
    if response.status_code != 200:
        said = (await response.aread())[:300].decode("utf-8", "replace")
        await response.aclose()
        log.info("agent of %s answered logs with %d: %s", node, response.status_code, said)
        if response.status_code == 404:
            raise Problem(404, "no-workload", "No workload", f"no workload runs on {node}: nothing to show")
        raise Problem(502, "agent-error", "Agent error", f"the agent of {node} answered {response.status_code}")

    async def text() -> AsyncIterator[str]:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        sent = 0
        try:
            async for piece in response.aiter_raw():
                sent += len(piece)
                yield decoder.decode(piece)
                if sent >= MAX_FOLLOW_BYTES:
                    break
            yield decoder.decode(b"", final=True)
        except httpx.HTTPError:
            log.info("the agent of %s stopped sending its workload's output", node)
        finally:
            await response.aclose()

    return StreamingResponse(text(), media_type=TEXT, headers={"X-Content-Type-Options": "nosniff"})
