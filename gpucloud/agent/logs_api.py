"""`GET /workload/logs` on a node's agent: the workload's output as the node keeps it
(`agent/workload_logs.py`), for the control plane (`protocol/logs.py`: the query, its bounds, who
may read). The bytes are the program's, handed over as they are (`text/plain`): the reader
decides what to do with bytes that are not UTF-8."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Annotated

from fastapi import FastAPI, Query
from fastapi.responses import Response, StreamingResponse

from gpucloud.agent import workload_logs
from gpucloud.agent.workloads import WorkloadSupervisor
from gpucloud.protocol.logs import MAX_TAIL_BYTES, WORKLOAD_LOGS_PATH, LogsQuery
from gpucloud.web import problems

FOLLOW_POLL_S = 0.5
TEXT = "text/plain; charset=utf-8"


def install_workload_logs(app: FastAPI, workloads: WorkloadSupervisor | None) -> None:
    """Serve the node's workload output at `WORKLOAD_LOGS_PATH` (the gate checks the caller)."""

    @app.get(WORKLOAD_LOGS_PATH, response_class=Response)
    async def workload_output(query: Annotated[LogsQuery, Query()]) -> Response:
        path = workloads.log_path() if workloads is not None else None
        if path is None:
            return problems.problem_response(
                404, "No workload", "no workload runs on this node (none was provisioned, or it was released)"
            )
        limits = workloads.log_limits  # type: ignore[union-attr]
        start = await asyncio.to_thread(workload_logs.size_of, path)
        head = await asyncio.to_thread(
            workload_logs.tail, path, limits, lines=query.tail, max_bytes=MAX_TAIL_BYTES, end=start
        )
        if not query.follow:
            return Response(head, media_type=TEXT)

        def running() -> bool:
            return workloads.status()["workload"] == "running"  # type: ignore[union-attr]

        def body() -> Iterator[bytes]:
            yield head
            yield from workload_logs.follow(
                path, since=start, running=running, deadline_s=query.follow_s, poll_s=FOLLOW_POLL_S
            )

        return StreamingResponse(body(), media_type=TEXT)
