"""`GET /workload/logs` on a node's agent: the workload's output as the node keeps it
(`agent/workload_logs.py`), for the control plane (`protocol/logs.py`: the query, its bounds, who
may read). The bytes are the program's, handed over as they are (`text/plain`): the reader
decides what to do with bytes that are not UTF-8. A container's output is the runtime's to keep
(`logs`, rotated by its log driver): read through the runtime's CLI, bounded the same way."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Query
from fastapi.responses import Response, StreamingResponse

from gpucloud import children
from gpucloud.agent import workload_logs
from gpucloud.agent.workloads import ContainerRuntime, WorkloadSupervisor
from gpucloud.protocol.logs import MAX_FOLLOW_BYTES, MAX_TAIL_BYTES, MAX_TAIL_LINES, WORKLOAD_LOGS_PATH, LogsQuery
from gpucloud.web import problems

FOLLOW_POLL_S = 0.5
TEXT = "text/plain; charset=utf-8"


def install_workload_logs(app: FastAPI, workloads: WorkloadSupervisor | None) -> None:
    """Serve the node's workload output at `WORKLOAD_LOGS_PATH` (the gate checks the caller)."""

    @app.get(WORKLOAD_LOGS_PATH, response_class=Response)
    async def workload_output(query: Annotated[LogsQuery, Query()]) -> Response:
        current = workloads.running() if workloads is not None else None
        if current is None:
            return problems.problem_response(
                404, "No workload", "no workload runs on this node (none was provisioned, or it was released)"
            )
        if current.container is not None:
            runtime = ContainerRuntime(current.runtime or "docker")
            tail = query.tail if query.tail is not None else MAX_TAIL_LINES
            argv = runtime.logs_argv(current.container, tail=tail, follow=query.follow)
            if not query.follow:
                return Response(await container_tail(argv), media_type=TEXT)
            return StreamingResponse(container_follow(argv, deadline_s=query.follow_s), media_type=TEXT)
        path = Path(current.log_path)
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


async def container_tail(argv: list[str], *, timeout_s: float = 30.0) -> bytes:
    """What the runtime prints of the container's output (`logs --tail N`), its last
    `MAX_TAIL_BYTES` at most however long its lines, within `timeout_s`."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        **children.popen_kwargs(),  # a follow ends only with the container: not with an agent gone
    )
    assert process.stdout is not None
    kept = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            while data := await process.stdout.read(workload_logs.READ_CHUNK):
                kept += data
                del kept[:-MAX_TAIL_BYTES]
    except TimeoutError:
        pass
    finally:
        await _ended(process)
    return bytes(kept)


async def container_follow(argv: list[str], *, deadline_s: float) -> AsyncIterator[bytes]:
    """The runtime's `logs --follow` as it comes, until the container stops (the runtime then
    ends it), `deadline_s` passed, or `MAX_FOLLOW_BYTES` were handed over."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        **children.popen_kwargs(),  # a follow ends only with the container: not with an agent gone
    )
    assert process.stdout is not None
    sent = 0
    try:
        async with asyncio.timeout(deadline_s):
            while sent < MAX_FOLLOW_BYTES and (data := await process.stdout.read(workload_logs.READ_CHUNK)):
                sent += len(data)
                yield data
    except TimeoutError:
        return
    finally:
        await _ended(process)


async def _ended(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    await process.wait()
