"""Chunk bodies between a client and the API: plain HTTP/1.1 with the bytes read into a reused
buffer, for the one path where the bytes themselves are the work.

httpx hands a response body over through h11's receive buffer: every byte is copied three times
in Python and lands in freshly allocated memory (one page fault per 4 KiB), which on a 2-core
machine costs the pull more CPU than receiving, hashing and writing the bytes together. Here the
socket reads straight into a buffer of `READ_SIZE` that the download owns, and the caller hashes
and writes from a view of it (`benchmarks/chunking.py`: see docs/registry.md "Known limits").

Everything else a client says to the API (JSON calls, retries of idempotent writes, errors as
`ApiError`) stays on httpx in `ApiClient`; this speaks to the same base URL with the same bearer
token and the same TLS trust (`tls.client_verify`), and reports errors the same way.

Connections are kept alive and shared through a free list: a download takes one, and gives it
back only when it has read its response to the end, so a download abandoned half-way (a hash
mismatch, a consumer that stopped) never leaves a connection with unread bytes for the next.
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpucloud.client.base import ApiError
from gpucloud.web import tls
from gpucloud.web.buffers import READ_SIZE

# What a broken connection raises here: reset, refused, timed out, cut short, garbled.
BROKEN = (OSError, http.client.HTTPException)
# What a kept-alive connection the server closed while it was idle raises at the next request.
STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ssl.SSLEOFError)


class BulkConnections:
    """Keep-alive connections to one API for chunk bodies, safe to use from many threads."""

    def __init__(self, base_url: str, token: str, *, timeout_s: float, read_size: int = READ_SIZE) -> None:
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._https = url.scheme == "https"
        self._host, self._port = url.hostname, url.port or (443 if self._https else 80)
        self._prefix = url.path.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}", "Accept-Encoding": "identity"}
        self._timeout_s, self._read_size = timeout_s, read_size
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def download(self, path: str) -> Iterator[memoryview]:
        """The body of `GET path`, piece by piece. Each piece is a view of a buffer the next piece
        overwrites: use it (hash it, write it) before asking for the next. An error answer raises
        `ApiError` before any piece; a broken connection raises one of `BROKEN`."""
        connection, response = self._send("GET", path)
        done = False
        try:
            if response.status >= 400:
                raise _api_error(response)
            buffer = memoryview(bytearray(self._read_size))
            while received := response.readinto(buffer):
                yield buffer[:received]
            if response.length:  # http.client takes a body cut short for its end; it is not
                raise http.client.IncompleteRead(b"", response.length)
            done = True
        finally:
            self._finish(connection, response, reusable=done)

    def upload(self, path: str, source: Path, offset: int, size: int) -> Any:
        """`PUT path` with bytes [offset, offset + size) of the file `source` as the body, sent
        by the kernel from the page cache (`sendfile`; read and sent from a reused buffer over
        TLS); the decoded JSON answer. An error answer raises `ApiError`, a broken connection one
        of `BROKEN`, a file shorter than the range `EOFError` (the connection is not reused)."""
        headers = {"Content-Length": str(size), "Content-Type": "application/octet-stream"}
        with open(source, "rb", buffering=0) as f:

            def body(connection: http.client.HTTPConnection) -> None:
                sock = connection.sock
                if not size:
                    sent = 0  # `sendfile` would take a count of 0 for "to the end of the file"
                elif self._https:
                    sent = _send_read(sock, f, offset, size, self._read_size)
                else:
                    sent = sock.sendfile(f, offset, size)
                if sent != size:
                    raise EOFError(
                        f"{source} ended inside bytes {offset}-{offset + size}: it changed since it was hashed"
                    )

            connection, response = self._send("PUT", path, headers, body)
        done = False
        try:
            payload = response.read()
            done = True
        finally:
            self._finish(connection, response, reusable=done)
        if response.status >= 400:
            raise ApiError.from_parts(response.status, payload, response.getheader("Retry-After", ""))
        return json.loads(payload) if payload else None

    def _send(
        self,
        method: str,
        path: str,
        headers: dict[str, str] | None = None,
        body: Callable[[http.client.HTTPConnection], None] | None = None,
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """The response's status and headers, on an idle connection if one still works (the server
        may have closed it meanwhile: then once more on a new one) or a new one. `body` sends the
        request's body on the connection once the headers are out."""
        with self._lock:
            connection = self._idle.pop() if self._idle else None
        if connection is not None:
            try:
                return connection, self._exchange(connection, method, path, headers, body)
            except STALE:  # closed by the server while idle: not a timeout, which could be a slow
                connection.close()  # server still at work on the first copy
        connection = self._connect()
        try:
            return connection, self._exchange(connection, method, path, headers, body)
        except BaseException:
            connection.close()
            raise

    def _exchange(
        self,
        connection: http.client.HTTPConnection,
        method: str,
        path: str,
        headers: dict[str, str] | None,
        body: Callable[[http.client.HTTPConnection], None] | None,
    ) -> http.client.HTTPResponse:
        if body is None:
            connection.request(method, self._prefix + path, headers=self._headers | (headers or {}))
        else:
            connection.putrequest(method, self._prefix + path, skip_accept_encoding=True)
            for name, value in (self._headers | (headers or {})).items():
                connection.putheader(name, value)
            connection.endheaders()
            try:
                body(connection)
            except EOFError:
                connection.close()
                raise
            except OSError as unsent:
                return _early_answer(connection, unsent)
        return connection.getresponse()

    def _connect(self) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=self._timeout_s, context=tls.client_verify()
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)

    def _finish(
        self, connection: http.client.HTTPConnection, response: http.client.HTTPResponse, *, reusable: bool
    ) -> None:
        if reusable and not response.will_close:
            response.close()
            with self._lock:
                self._idle.append(connection)
        else:
            connection.close()


def _early_answer(connection: http.client.HTTPConnection, unsent: OSError) -> http.client.HTTPResponse:
    """The error answer a server (or a proxy) sent before it stopped reading the body and closed
    (a 413, 401, 409 as soon as it saw the headers): that, not the broken pipe, is what to report.
    Anything else, no answer or a success for a body it did not read, is the send's failure."""
    try:
        response = connection.getresponse()
    except BROKEN:
        raise unsent from None
    if response.status < 400:
        raise unsent
    response.will_close = True  # the rest of the body never went: the connection is done
    return response


def _send_read(sock: socket.socket, f: io.RawIOBase, offset: int, size: int, piece: int) -> int:
    """Send bytes [offset, offset + size) of `f` through a buffer (where `sendfile` cannot go)."""
    buffer = memoryview(bytearray(min(piece, size) or 1))
    f.seek(offset)
    sent = 0
    while sent < size and (count := f.readinto(buffer[: min(len(buffer), size - sent)])):
        sock.sendall(buffer[:count])
        sent += count
    return sent


def _api_error(response: http.client.HTTPResponse) -> ApiError:
    body = response.read(64 * 1024)
    return ApiError.from_parts(response.status, body, response.getheader("Retry-After", ""))
