"""Chunk bodies over `BulkConnections`: real HTTP against a uvicorn server, downloads and uploads
(file ranges sent with `sendfile`) over one keep-alive connection reused, nothing half-read or
half-sent handed on, errors reported as the rest of the client does."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gpucloud.client import bulk as bulk_module
from gpucloud.client.base import ApiError
from gpucloud.client.bulk import BROKEN, BulkConnections
from gpucloud.client.registry import RegistryClient
from gpucloud.registry.manifest import ChunkRef
from gpucloud.web import tls
from gpucloud.web.serving import ThreadedServer
from gpucloud.web.tls import LocalCA

pytestmark = pytest.mark.integration

READ = 256 * 1024
UPLOADS: list[bytes] = []  # the bodies the test server received, in order
BUSY_ONCE: set[str] = set()  # chunks whose upload the test server has answered 503 once


def body(size: int) -> bytes:
    return bytes(i * 7 % 251 for i in range(251)) * (size // 251) + b"x" * (size % 251)


def build_app() -> FastAPI:
    """The test server: blobs to download, bodies to upload, answers of every kind."""
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

    @app.put("/v1/blob", dependencies=[Depends(admit)])
    async def put(request: Request) -> dict:
        data = b"".join([piece async for piece in request.stream()])
        UPLOADS.append(data)
        return {"stored": True, "size": len(data)}

    @app.put("/v1/models/{model}/chunks/{chunk_id}", dependencies=[Depends(admit)])
    async def put_chunk(model: str, chunk_id: str, request: Request) -> Response:
        data = await request.body()
        if chunk_id not in BUSY_ONCE:  # the first try of each chunk finds the API busy
            BUSY_ONCE.add(chunk_id)
            problem = {"type": "https://gpucloud.dev/problems/busy", "title": "Busy", "detail": "try later"}
            return JSONResponse(problem, 503, headers={"Retry-After": "0"}, media_type="application/problem+json")
        UPLOADS.append(data)
        return JSONResponse({"id": chunk_id, "size": len(data), "stored": True}, 201)

    @app.put("/v1/refuse")
    async def refuse(request: Request) -> Response:
        await request.body()
        problem = {"type": "https://gpucloud.dev/problems/chunk-too-large", "title": "Too large", "detail": "no"}
        return JSONResponse(problem, 413, media_type="application/problem+json")

    return app


@pytest.fixture(scope="module")
def server():
    app = build_app()
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


def test_uploads_send_file_ranges_whole_over_one_kept_alive_connection(server, tmp_path: Path, monkeypatch):
    """Sent by the kernel from the page cache (`sendfile`), not read into the process."""
    running, peers = server
    peers.clear()
    sendfiles, real_sendfile = [], os.sendfile

    def sendfile(out_fd: int, in_fd: int, offset, count: int) -> int:
        sendfiles.append(count)
        return real_sendfile(out_fd, in_fd, offset, count)

    monkeypatch.setattr(os, "sendfile", sendfile)
    monkeypatch.setattr("gpucloud.client.bulk._send_read", None)  # the TLS path: not taken here
    expected = []
    source = tmp_path / "weights.bin"
    source.write_bytes(body(5 * READ + 17))
    ranges = [(0, 0), (0, 1), (3, READ + 5), (READ, 4 * READ + 17)]
    bulk = BulkConnections(running.url, "sesame", timeout_s=10, read_size=READ)
    try:
        for offset, size in ranges:
            answer = bulk.upload("/v1/blob", source, offset, size)
            assert answer == {"stored": True, "size": size}
            expected.append(body(5 * READ + 17)[offset : offset + size])
    finally:
        bulk.close()
    assert UPLOADS[-len(ranges) :] == expected
    assert len(peers) == len(ranges) and len(set(peers)) == 1
    assert sendfiles and sum(sendfiles) >= sum(size for _, size in ranges)


def test_an_upload_from_a_file_shorter_than_its_range_fails_and_drops_its_connection(server, tmp_path: Path):
    running, peers = server
    peers.clear()
    source = tmp_path / "shrunk.bin"
    source.write_bytes(body(1000))
    received = len(UPLOADS)
    bulk = BulkConnections(running.url, "sesame", timeout_s=10, read_size=READ)
    try:
        with pytest.raises(EOFError, match="changed since it was hashed"):
            bulk.upload("/v1/blob", source, 500, 1000)  # the file ends 500 bytes in
        assert not bulk._idle  # the cut connection is not kept for the next request
        assert bulk.upload("/v1/blob", source, 0, 1000) == {"stored": True, "size": 1000}
    finally:
        bulk.close()
    assert UPLOADS[received:] == [body(1000)]  # the server never took the short body for whole
    # The cut request reaches the server's handler or not, as the close races it; the upload
    # after it came on a connection of its own either way.
    assert 1 <= len(peers) <= 2 and len(set(peers)) == len(peers)


def test_an_upload_refused_is_an_api_error_and_its_connection_carries_on(server, tmp_path: Path):
    running, peers = server
    source = tmp_path / "weights.bin"
    source.write_bytes(body(3 * READ))
    bulk = BulkConnections(running.url, "sesame", timeout_s=10, read_size=READ)
    try:
        with pytest.raises(ApiError) as refused:
            bulk.upload("/v1/refuse", source, 0, 3 * READ)
        assert (refused.value.status, refused.value.type) == (413, "chunk-too-large")
        peers.clear()
        assert bulk.upload("/v1/blob", source, 0, 2 * READ)["size"] == 2 * READ
        time.sleep(2.5)  # past the server's keep-alive timeout: the next upload needs a new connection
        assert bulk.upload("/v1/blob", source, READ, 2 * READ)["size"] == 2 * READ
    finally:
        bulk.close()
    assert UPLOADS[-1] == body(3 * READ)[READ:]
    assert len(set(peers)) == 2


def test_a_chunk_upload_the_api_was_too_busy_for_is_sent_again(server, tmp_path: Path):
    running, _ = server
    source = tmp_path / "weights.bin"
    source.write_bytes(body(2 * READ))
    chunk = ChunkRef(id="ab" * 32, offset=READ, size=READ)
    with RegistryClient(running.url, "sesame") as client:
        assert client.upload("llama", source, chunk) is True
    assert chunk.id in BUSY_ONCE and UPLOADS[-1] == body(2 * READ)[READ:]


def test_chunk_bodies_travel_whole_over_tls(tmp_path: Path, monkeypatch):
    """Over TLS an upload cannot use `sendfile`: it is read and sent from one buffer."""
    read_and_sent, real_send_read = [], bulk_module._send_read

    def send_read(*args) -> int:
        read_and_sent.append(args[3])
        return real_send_read(*args)

    monkeypatch.setattr("gpucloud.client.bulk._send_read", send_read)
    ca = LocalCA(tmp_path / "ca")
    app = build_app()
    source = tmp_path / "weights.bin"
    source.write_bytes(body(3 * READ + 5))
    tls.trust(ca.cert_file)
    with ThreadedServer(app, name="bulk-tls", tls=ca.issue("api", ["127.0.0.1"])) as secure:
        assert secure.url.startswith("https://")
        bulk = BulkConnections(secure.url, "sesame", timeout_s=10, read_size=READ)
        try:
            assert bulk.upload("/v1/blob", source, 7, 3 * READ - 2) == {"stored": True, "size": 3 * READ - 2}
            assert UPLOADS[-1] == body(3 * READ + 5)[7 : 3 * READ + 5]
            assert read_and_sent == [3 * READ - 2]
            assert read_all(bulk, f"/v1/blob/{2 * READ + 1}")[0] == body(2 * READ + 1)
        finally:
            bulk.close()


class SocketServer:
    """A bare socket server on a free loopback port: each connection, counted, goes to `handle`
    and is closed after it. For what a uvicorn app cannot do (answer before the body, reset)."""

    def __init__(self) -> None:
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                data = b""
                while b"\r\n\r\n" not in data and (more := conn.recv(65536)):
                    data += more
                head, _, received = data.partition(b"\r\n\r\n")
                self.handle(conn, head, received)

    def handle(self, conn: socket.socket, head: bytes, received: bytes) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.sock.close()


class RawServer(SocketServer):
    """Answers each connection with `answer` as soon as the request's headers are in, without
    reading the body, then closes: what a proxy with a body limit does."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        super().__init__()

    def handle(self, conn: socket.socket, head: bytes, received: bytes) -> None:
        conn.sendall(self.answer)
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(1)
        with contextlib.suppress(OSError):
            conn.recv(65536)  # a little of the body, then the close resets the sender


def test_an_error_answered_before_the_body_was_read_is_reported_at_once(tmp_path: Path):
    problem = b'{"type": "https://gpucloud.dev/problems/chunk-too-large", "title": "Too large", "detail": "no"}'
    server = RawServer(
        b"HTTP/1.1 413 Content Too Large\r\nContent-Type: application/problem+json\r\n"
        b"Connection: close\r\nContent-Length: " + str(len(problem)).encode() + b"\r\n\r\n" + problem
    )
    source = tmp_path / "weights.bin"
    source.write_bytes(bytes(32 << 20))  # far more than the sockets' buffers hold
    chunk = ChunkRef(id="cd" * 32, offset=0, size=32 << 20)
    started = time.monotonic()
    try:
        with RegistryClient(server.url, "sesame") as client, pytest.raises(ApiError) as refused:
            client.upload("llama", source, chunk)
    finally:
        server.close()
    assert (refused.value.status, refused.value.type) == (413, "chunk-too-large")
    assert time.monotonic() - started < 10 and server.connections == 1  # not retried as a broken pipe


def test_an_answer_cut_short_does_not_leave_its_connection_for_the_next_request(tmp_path: Path):
    server = RawServer(b"HTTP/1.1 201 Created\r\nContent-Length: 100\r\n\r\n" + b'{"stored": tr')
    source = tmp_path / "weights.bin"
    source.write_bytes(b"x" * 100)
    bulk = BulkConnections(server.url, "sesame", timeout_s=5)
    try:
        with pytest.raises(BROKEN):
            bulk.upload("/v1/blob", source, 0, 100)
        assert not bulk._idle  # nothing half-read is handed to the next request
    finally:
        bulk.close()
        server.close()


class CuttingServer(SocketServer):
    """Cuts its first connection (a reset) once part of an upload's body is in, with no answer,
    and stores every later upload whole: a connection lost mid-upload."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        super().__init__()

    def handle(self, conn: socket.socket, head: bytes, received: bytes) -> None:
        length = next(
            int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
        )
        if self.connections == 1:
            while len(received) < length // 4 and (more := conn.recv(65536)):
                received += more
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            return  # closed with a reset, mid-body, no answer
        while len(received) < length and (more := conn.recv(1 << 20)):
            received += more
        self.bodies.append(received)
        answer = b'{"stored": true}'
        conn.sendall(
            b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: " + str(len(answer)).encode() + b"\r\n\r\n" + answer
        )


def test_a_chunk_upload_cut_mid_body_is_sent_again_whole(tmp_path: Path):
    server = CuttingServer()
    source = tmp_path / "weights.bin"
    source.write_bytes(body(16 << 20))
    chunk = ChunkRef(id="ef" * 32, offset=5, size=(16 << 20) - 5)
    try:
        with RegistryClient(server.url, "sesame") as client:
            assert client.upload("llama", source, chunk) is True
    finally:
        server.close()
    assert server.connections == 2
    assert server.bodies == [body(16 << 20)[5:]]
