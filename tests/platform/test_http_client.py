"""The one httpx client factory: the named timeout reaches every request, the trust given is the
trust used, verification never turns off, and nothing is read from settings."""

from __future__ import annotations

import ast
import asyncio
import ssl
import sys
from pathlib import Path

import httpx
import pytest

import gpucloud.config
from gpucloud.web import http_client as factory
from gpucloud.web.http_client import TIMEOUTS, async_http_client, http_client, ssl_context, timeout_for
from gpucloud.web.tls import LocalCA

pytestmark = pytest.mark.unit


def _timeouts_seen(requests: list[httpx.Request]) -> list[dict]:
    return [request.extensions["timeout"] for request in requests]


def test_every_named_timeout_is_bounded() -> None:
    for name, named in TIMEOUTS.items():
        timeout = timeout_for(name)
        assert 0 < timeout.connect <= timeout.read == named.seconds, name
        assert timeout.write == timeout.pool == named.seconds, name


def test_the_named_timeout_reaches_each_request() -> None:
    seen: list[httpx.Request] = []
    transport = httpx.MockTransport(lambda request: seen.append(request) or httpx.Response(200))
    with http_client(timeout="fabric_manager", trust=ssl.create_default_context(), transport=transport) as client:
        client.get("http://manager/ufm")
    assert _timeouts_seen(seen) == [{"connect": 5.0, "read": 10.0, "write": 10.0, "pool": 10.0}]


def test_timeout_s_replaces_the_total_under_the_named_connect_limit() -> None:
    assert timeout_for("api", seconds=60.0) == httpx.Timeout(60.0, connect=10.0)
    assert timeout_for("api", seconds=3.0) == httpx.Timeout(3.0)
    assert timeout_for("ledger", seconds=45.0) == httpx.Timeout(45.0)
    assert timeout_for("agent_action", seconds=60.0) == httpx.Timeout(60.0, connect=5.0)


async def test_the_async_client_takes_the_same_options() -> None:
    seen: list[httpx.Request] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200)

    async with async_http_client(
        timeout="ledger",
        timeout_s=7.0,
        trust=ssl.create_default_context(),
        base_url="http://ledger",
        headers={"Authorization": "Bearer t"},
        transport=httpx.MockTransport(answer),
    ) as client:
        await client.get("/v1/usage")
    assert str(seen[0].url) == "http://ledger/v1/usage"
    assert seen[0].headers["authorization"] == "Bearer t"
    assert _timeouts_seen(seen) == [{"connect": 7.0, "read": 7.0, "write": 7.0, "pool": 7.0}]


async def test_an_async_request_over_a_socket_imports_nothing() -> None:
    """httpcore asks for `sniffio` on every async request (its locks, events and cancel shields);
    where that import fails, each ask walks every import path again (a third of the request's CPU,
    measured). With the dependency installed, a request after the first finds every module it
    needs already loaded."""

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    class Asked:
        def __init__(self) -> None:
            self.names: list[str] = []

        def find_spec(self, name, path=None, target=None):
            self.names.append(name)
            return None  # the finders after this one answer

    server = await asyncio.start_server(respond, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    asked = Asked()
    try:
        async with async_http_client(timeout="api", trust=ssl.create_default_context()) as client:
            assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"  # the first loads what it needs
            sys.meta_path.insert(0, asked)
            for _ in range(3):
                assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"
    finally:
        if asked in sys.meta_path:
            sys.meta_path.remove(asked)
        server.close()
        await server.wait_closed()
    assert asked.names == []


def test_the_ssl_context_given_is_the_one_used() -> None:
    context = ssl.create_default_context()
    with http_client(timeout="api", trust=context) as client:
        assert client._transport._pool._ssl_context is context  # type: ignore[attr-defined]


def test_a_ca_file_is_trusted(tmp_path: Path) -> None:
    ca = LocalCA(tmp_path / "ca")
    context = ssl_context(ca.cert_file)
    subjects = [dict(part[0] for part in cert["subject"]) for cert in context.get_ca_certs()]
    assert {"organizationName": "gpucloud", "commonName": "gpucloud local CA"} in subjects


@pytest.mark.parametrize("trust", [False, True, None])
def test_verification_is_never_turned_off_or_left_to_a_default(trust) -> None:
    with pytest.raises(TypeError, match="verification"):
        http_client(timeout="api", trust=trust)


def test_no_settings_are_read(monkeypatch) -> None:
    def no_settings():
        raise AssertionError("the factory read the settings")

    monkeypatch.setattr(gpucloud.config, "get_settings", no_settings)
    monkeypatch.setenv("GPUCLOUD_TLS__CA_FILE", "/nonexistent/ca.pem")
    with http_client(timeout="simulator", trust=ssl.create_default_context()) as client:
        assert client.timeout == httpx.Timeout(10.0)
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(ast.parse(Path(factory.__file__).read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not {name for name in imported if name and name.startswith("gpucloud")}
