"""`GET /v1/nodes/{node_id}/workload/logs` on the simulated fleet: each node's workload output as
its agent would serve it (`protocol/logs.py`), synthesized from the workload's command
(`sim/workload_output.py`); the fleet's gate checks the caller as a real agent does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import FastAPI, Query
from fastapi.responses import Response, StreamingResponse

from gpucloud.protocol.logs import WORKLOAD_LOGS_PATH, LogsQuery
from gpucloud.sim.nodes import Fleet
from gpucloud.sim.workload_output import follow_text, tail_text
from gpucloud.web import problems

TEXT = "text/plain; charset=utf-8"


def install_workload_logs(app: FastAPI, fleet: Fleet) -> None:
    @app.get(f"/v1/nodes/{{node_id}}{WORKLOAD_LOGS_PATH}", response_class=Response)
    async def workload_output(node_id: str, query: Annotated[LogsQuery, Query()]) -> Response:
        node = fleet.node(node_id)
        run = node.workload_run
        if run is None or node.unreachable:
            if node.unreachable:
                return problems.problem_response(503, "Agent unreachable", f"agent on {node.id} does not answer")
            return problems.problem_response(
                404, "No workload", "no workload runs on this node (none was provisioned, or it was released)"
            )
        started = node.workload_started_s
        head, printed = tail_text(run, fleet.clock() - started, lines=query.tail)
        if not query.follow:
            return Response(head, media_type=TEXT)

        async def body() -> AsyncIterator[str]:
            yield head
            async for text in follow_text(
                run,
                started,
                since=printed,
                deadline_s=query.follow_s,
                running=lambda: node.workload_run is run,
                clock=fleet.clock,
            ):
                yield text

        return StreamingResponse(body(), media_type=TEXT)
