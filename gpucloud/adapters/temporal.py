"""The one Temporal client factory (pydantic data converter plus the payload codec), used by
workers, API, CLI, tests and replay.

TLS and an API key come from the settings through temporalio's own connection options: the
frontend's CA, a client certificate and key for mutual TLS, the server name to verify, and an
API key sent as a bearer token (Temporal Cloud, or a cluster with an authorizer).

Every payload is sealed before it leaves the process (`EncryptionCodec`: AES-256-GCM), so a
workload's environment, its SSH keys and an evaluation's environment never sit in clear in
Temporal's histories, its database or its Web UI. Keys are a list, newest last
(`CodecKeys.parse`): new payloads are sealed with the newest, and each names its key's id in its
metadata, so a payload sealed before a rotation still opens with the key it names. A payload
without the codec's encoding (one recorded before the codec existed) is read as it is.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from temporalio.api.common.v1 import Payload
from temporalio.client import Client, Interceptor, TLSConfig
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter, PayloadCodec
from temporalio.runtime import LogForwardingConfig, LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter

from gpucloud.config import Settings, TemporalSettings, write_private
from gpucloud.observability import tracing
from gpucloud.retry import Backoff, retry_call_async

ENCODING = b"binary/encrypted"
KEY_ID = "encryption-key-id"
_NONCE_BYTES = 12


def new_codec_key() -> str:
    """A fresh key as it is kept: base64 of 32 random bytes."""
    return base64.b64encode(AESGCM.generate_key(bit_length=256)).decode()


@dataclass(frozen=True)
class CodecKeys:
    """The payload keys by id, in the order given: the last one seals new payloads."""

    keys: dict[str, bytes]

    @classmethod
    def parse(cls, text: str) -> CodecKeys:
        """Keys as kept (base64 of 32 bytes each, separated by newlines, spaces or commas; the
        newest last). A key's id is derived from the key, so a wrong key can never pass for the
        one a payload names."""
        keys: dict[str, bytes] = {}
        for encoded in re.split(r"[\s,]+", text.strip()):
            if not encoded:
                continue
            try:
                key = base64.b64decode(encoded, validate=True)
            except ValueError:
                key = b""
            if len(key) != 32:
                raise ValueError("a Temporal payload key must be base64 of 32 bytes (GPUCLOUD_TEMPORAL__CODEC_KEYS)")
            keys.pop(key_id(key), None)  # a key listed twice counts where it was listed last
            keys[key_id(key)] = key
        if not keys:
            raise ValueError("no Temporal payload key (GPUCLOUD_TEMPORAL__CODEC_KEYS)")
        return cls(keys)

    @property
    def active(self) -> str:
        return next(reversed(self.keys))


def key_id(key: bytes) -> str:
    return "tk-" + hashlib.sha256(key).hexdigest()[:12]


def add_codec_key(path: Path) -> str:
    """Append a new key to the keys kept in `path` (0600), so it seals from the next start on;
    returns its id."""
    kept = path.read_text().strip() if path.exists() else ""
    key = new_codec_key()
    write_private(path, f"{kept}\n{key}\n".lstrip())
    return key_id(base64.b64decode(key))


class EncryptionCodec(PayloadCodec):
    """AES-256-GCM over each whole payload (its metadata too: the encoding names its type); the
    key id is the associated data, so a payload cannot be relabelled to another key."""

    def __init__(self, keys: CodecKeys) -> None:
        self.keys = keys
        self._ciphers = {kid: AESGCM(key) for kid, key in keys.keys.items()}

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.seal(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.open(p) for p in payloads]

    def seal(self, payload: Payload) -> Payload:
        kid = self.keys.active
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self._ciphers[kid].encrypt(nonce, payload.SerializeToString(), kid.encode())
        return Payload(metadata={"encoding": ENCODING, KEY_ID: kid.encode()}, data=nonce + sealed)

    def open(self, payload: Payload) -> Payload:
        if payload.metadata.get("encoding") != ENCODING:
            return payload  # recorded before the codec: nothing to open
        kid = payload.metadata.get(KEY_ID, b"").decode(errors="replace")
        cipher = self._ciphers.get(kid)
        if cipher is None:
            raise ValueError(f"a payload is sealed with key {kid!r}, which is not among the configured keys")
        try:
            clear = cipher.decrypt(payload.data[:_NONCE_BYTES], payload.data[_NONCE_BYTES:], kid.encode())
        except InvalidTag:
            raise ValueError(f"a payload sealed with key {kid!r} failed its integrity check") from None
        return Payload.FromString(clear)


def data_converter(keys: CodecKeys) -> DataConverter:
    """The pydantic converter with every payload sealed by `keys`."""
    return dataclasses.replace(pydantic_data_converter, payload_codec=EncryptionCodec(keys))


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


# The SDK's core (Rust) writes its own log lines to stderr as coloured text; forwarded instead,
# they go through Python's logging as `temporalio.core.<target>`, in the process's format (one
# JSON object a line under `telemetry.log_format=json`).
CORE_LOGGER = logging.getLogger("temporalio.core")


def core_logging() -> LoggingConfig:
    return LoggingConfig(
        filter=TelemetryFilter(core_level="WARN", other_level="ERROR"),
        forwarding=LogForwardingConfig(logger=CORE_LOGGER),
    )


_runtime: Runtime | None = None


def default_runtime() -> Runtime:
    """The process's one runtime for clients that bring none: the SDK's default, its core's logs
    forwarded (`core_logging`)."""
    global _runtime
    if _runtime is None:
        _runtime = Runtime(telemetry=TelemetryConfig(logging=core_logging()))
    return _runtime


async def connect(
    settings: TemporalSettings,
    *,
    keys: CodecKeys,
    runtime: Runtime | None = None,
    interceptors: Sequence[Interceptor] = (),
) -> Client:
    return await Client.connect(
        settings.address,
        namespace=settings.namespace,
        data_converter=data_converter(keys),
        tls=tls_config(settings),
        api_key=settings.api_key.get_secret_value() if settings.api_key else None,
        runtime=runtime or default_runtime(),
        interceptors=interceptors,
    )


def codec_keys(settings: Settings) -> CodecKeys:
    """The keys that seal Temporal payloads: every client of one deployment needs the same."""
    return CodecKeys.parse(settings.temporal_codec_keys)


async def connect_when_up(settings: Settings, *, wait_s: float = 30.0, runtime: Runtime | None = None) -> Client:
    """The deployment's Temporal client (its payload keys, the tracing interceptors), once the
    server answers: processes of a stack start together, and the SDK raises RuntimeError while the
    server does not answer yet, so it is asked every half second for at most `wait_s`.
    `bootstrap.temporal_client` for the control plane's processes; the evaluation worker calls it
    directly, holding nothing else of the platform (`workers/evaluation.py`)."""
    keys = codec_keys(settings)

    async def connected() -> Client:
        return await connect(
            settings.temporal, keys=keys, runtime=runtime, interceptors=tracing.temporal_interceptors()
        )

    return await retry_call_async(
        connected, retry_on=RuntimeError, backoff=Backoff(first_s=0.5, cap_s=0.5), attempts=None, deadline_s=wait_s
    )
