"""The one Temporal client factory (pydantic data converter), used by workers, API, CLI and tests.

TLS and an API key come from the settings through temporalio's own connection options: the
frontend's CA, a client certificate and key for mutual TLS, the server name to verify, and an
API key sent as a bearer token (Temporal Cloud, or a cluster with an authorizer).
"""

from __future__ import annotations

from collections.abc import Sequence

from temporalio.client import Client, Interceptor, TLSConfig
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import Runtime

from gpucloud.config import TemporalSettings


def tls_config(settings: TemporalSettings) -> TLSConfig | bool:
    files = (settings.tls_ca_file, settings.tls_cert_file, settings.tls_key_file)
    if not settings.tls and not any(files) and settings.tls_server_name is None:
        return False
    if (settings.tls_cert_file is None) != (settings.tls_key_file is None):
        raise ValueError(
            "mutual TLS to Temporal needs both GPUCLOUD_TEMPORAL__TLS_CERT_FILE and GPUCLOUD_TEMPORAL__TLS_KEY_FILE"
        )
    return TLSConfig(
        server_root_ca_cert=settings.tls_ca_file.read_bytes() if settings.tls_ca_file else None,
        client_cert=settings.tls_cert_file.read_bytes() if settings.tls_cert_file else None,
        client_private_key=settings.tls_key_file.read_bytes() if settings.tls_key_file else None,
        domain=settings.tls_server_name,
    )


async def connect(
    settings: TemporalSettings, *, runtime: Runtime | None = None, interceptors: Sequence[Interceptor] = ()
) -> Client:
    return await Client.connect(
        settings.address,
        namespace=settings.namespace,
        data_converter=pydantic_data_converter,
        tls=tls_config(settings),
        api_key=settings.api_key.get_secret_value() if settings.api_key else None,
        runtime=runtime,
        interceptors=interceptors,
    )
