"""Chunk bodies over `BulkConnections`: real HTTP against a uvicorn server, one keep-alive
connection reused, nothing half-read handed on, errors reported as the rest of the client does."""

from __future__ import annotations

import time

import pytest
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gpucloud.client.base import ApiError
from gpucloud.client.bulk import BROKEN, BulkConnections
from gpucloud.devstack.serving import ThreadedServer

READ = 256 * 1024


def body(size: int) -> bytes:
    return bytes(i * 7 % 251 for i in range(251)) * (size // 251) + b"x" * (size % 251)


@pytest.fixture(scope="module")
def server():
    app = FastAPI()
    app.state.peers = []

    def admit(request: Request) -> None:
        if request.headers.get("authorization") != "Bearer sesame":
            raise HTTPException(401, "no")
        app.state.peers.append(request.client.port if request.client else None)

    @app.get("/v1/blob/{size}", dependencies=[Depends(admit)])
    def blob(size: int) -> Response:
        return Response(body(size), media_type="application/octet-stream")

    @app.get("/v1/busy")
    def busy() -> Response:
        problem = {"type": "https://gpucloud.dev/problems/busy", "title": "Busy", "detail": "try later"}
        return JSONResponse(problem, 503, headers={"Retry-After": "2"}, media_type="application/problem+json")

    @app.get("/v1/cut", dependencies=[Depends(admit)])
    def cut() -> StreamingResponse:
        def pieces():
            yield b"a" * READ
            raise RuntimeError("the store failed half-way")

        return StreamingResponse(pieces(), headers={"Content-Length": str(4 * READ)})

    with ThreadedServer(app, name="bulk-test", timeout_keep_alive=1) as running:
        yield running, app.state.peers


def read_all(bulk: BulkConnections, path: str) -> tuple[bytes, list[int]]:
    data, sizes = bytearray(), []
    for piece in bulk.download(path):
        assert isinstance(piece, memoryview)
        sizes.append(len(piece))
        data += piece
    return bytes(data), sizes


def test_bodies_arrive_whole_over_one_kept_alive_connection(server):
    running, peers = server
    peers.clear()
    bulk = BulkConnections(running.url, "sesame", timeout_s=10, read_size=READ)
    try:
        for size in (0, 1, 3 * READ + 17, 5 * READ):
            data, sizes = read_all(bulk, f"/v1/blob/{size}")
            assert data == body(size)
            assert all(0 < s <= READ for s in sizes)
    finally:
        bulk.close()
    assert len(peers) == 4 and len(set(peers)) == 1


def test_an_abandoned_download_never_hands_its_connection_on(server):
    running, peers = server
    peers.clear()
    bulk = BulkConnections(running.url, "sesame", timeout_s=10, read_size=READ)
    try:
        pieces = bulk.download(f"/v1/blob/{8 * READ}")
        first = bytes(next(pieces))
        pieces.close()  # e.g. the puller found the bytes bad and stopped reading
        assert first == body(8 * READ)[: len(first)]
        data, _ = read_all(bulk, f"/v1/blob/{2 * READ}")
        assert data == body(2 * READ)
    finally:
        bulk.close()
    assert len(set(peers)) == 2  # the half-read connection was closed, not reused


def test_a_connection_the_server_closed_is_replaced(server):
    running, peers = server
    peers.clear()
    bulk = BulkConnections(running.url, "sesame", timeout_s=10, read_size=READ)
    try:
        assert read_all(bulk, "/v1/blob/1000")[0] == body(1000)
        time.sleep(2.5)  # past the server's keep-alive timeout: it closes the idle connection
        assert read_all(bulk, "/v1/blob/2000")[0] == body(2000)
    finally:
        bulk.close()
    assert len(set(peers)) == 2


def test_an_error_answer_is_an_api_error_with_its_problem_and_retry_after(server):
    running, _ = server
    bulk = BulkConnections(running.url, "sesame", timeout_s=10)
    try:
        with pytest.raises(ApiError) as busy:
            next(bulk.download("/v1/busy"))
        assert (busy.value.status, busy.value.type, busy.value.retry_after_s) == (503, "busy", 2.0)
        with pytest.raises(ApiError) as refused:
            next(BulkConnections(running.url, "wrong", timeout_s=10).download("/v1/blob/10"))
        assert refused.value.status == 401
        # The connection that carried the error answers the next request correctly.
        assert read_all(bulk, "/v1/blob/300")[0] == body(300)
    finally:
        bulk.close()


def test_a_body_cut_short_raises_a_broken_transfer(server):
    running, _ = server
    bulk = BulkConnections(running.url, "sesame", timeout_s=10, read_size=READ)
    received = 0
    try:
        with pytest.raises(BROKEN):
            for piece in bulk.download("/v1/cut"):
                received += len(piece)
    finally:
        bulk.close()
    assert received < 4 * READ


def test_only_http_urls_are_taken():
    with pytest.raises(ValueError, match="not an http"):
        BulkConnections("ftp://example.com", "t", timeout_s=1)
