"""The Temporal client over TLS: the CA, a client certificate and an API key come from the settings
through temporalio's own connection options (`adapters/temporal.py`).

The dev server has no TLS flags, so a TLS-terminating proxy (HTTP/2 by ALPN, a client
certificate required) stands in front of it, as a load balancer does in front of a cluster."""

from __future__ import annotations

import asyncio
import contextlib
import ssl

import pytest
from pydantic import SecretStr

from gpucloud.adapters.temporal import CodecKeys, connect, new_codec_key
from gpucloud.config import TemporalSettings
from gpucloud.web.tls import LocalCA

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

KEYS = CodecKeys.parse(new_codec_key())


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


@contextlib.asynccontextmanager
async def tls_proxy(upstream: str, context: ssl.SSLContext):
    """Terminate TLS on a free loopback port and pass the plaintext to `upstream` (host:port)."""
    host, port = upstream.rsplit(":", 1)
    handshakes: list[str] = []

    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        peer = client_writer.get_extra_info("peercert")
        handshakes.append(dict(x[0] for x in peer["subject"])["commonName"] if peer else "")
        server_reader, server_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(_pipe(client_reader, server_writer), _pipe(server_reader, client_writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}", handshakes
    finally:
        server.close()


def _server_context(ca: LocalCA) -> ssl.SSLContext:
    leaf = ca.issue("frontend", ["localhost", "127.0.0.1"])
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ca.cert_file))
    context.load_cert_chain(str(leaf.cert_file), str(leaf.key_file))
    context.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: only clients our CA certified
    context.set_alpn_protocols(["h2"])
    return context


async def test_workers_and_the_api_reach_temporal_over_mutual_tls_with_an_api_key(temporal_env, tmp_path):
    ca = LocalCA(tmp_path / "tls")
    client_cert = ca.issue("worker", ["gpucloud-worker"], client=True)
    upstream = temporal_env.client.service_client.config.target_host
    async with tls_proxy(upstream, _server_context(ca)) as (address, handshakes):
        settings = TemporalSettings(
            address=address,
            tls_ca_file=ca.cert_file,
            tls_cert_file=client_cert.cert_file,
            tls_key_file=client_cert.key_file,
            tls_server_name="localhost",
            api_key=SecretStr("gpucloud-test-key"),
        )
        client = await asyncio.wait_for(connect(settings, keys=KEYS), 30)
        assert client.service_client.config.api_key == "gpucloud-test-key"
        await client.count_workflows()
        assert "gpucloud-worker" in handshakes  # the proxy saw our client certificate

        # Without a client certificate the frontend refuses the handshake.
        no_cert = settings.model_copy(update={"tls_cert_file": None, "tls_key_file": None})
        with pytest.raises(RuntimeError):
            await asyncio.wait_for(connect(no_cert, keys=KEYS), 30)
        # Against the system's CAs only, our private CA's frontend is not trusted.
        system_roots = settings.model_copy(update={"tls_ca_file": None})
        with pytest.raises(RuntimeError):
            await asyncio.wait_for(connect(system_roots, keys=KEYS), 30)


def test_half_a_client_certificate_is_a_configuration_error(tmp_path):
    from gpucloud.adapters.temporal import tls_config

    ca = LocalCA(tmp_path / "tls")
    leaf = ca.issue("worker", ["w"], client=True)
    with pytest.raises(ValueError, match="TLS_KEY_FILE"):
        tls_config(TemporalSettings(tls_cert_file=leaf.cert_file))
    assert tls_config(TemporalSettings()) is False
    assert tls_config(TemporalSettings(tls=True)) is not False


@pytest.mark.parametrize("address", ["temporal:7233", "10.0.0.5:7233", "[2001:db8::1]:7233"])
def test_a_frontend_off_loopback_without_tls_is_refused_unless_allowed(address):
    with pytest.raises(ValueError, match=r"GPUCLOUD_TEMPORAL__TLS=true.*GPUCLOUD_TEMPORAL__ALLOW_INSECURE=true"):
        TemporalSettings(address=address)
    assert TemporalSettings(address=address, tls=True).address == address
    assert TemporalSettings(address=address, allow_insecure=True).address == address
    for loopback in ("127.0.0.1:7233", "localhost:7233", "[::1]:7233"):
        assert TemporalSettings(address=loopback).address == loopback
