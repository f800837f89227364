"""TLS on every hop: the servers' certificates, the one trust every client verifies against, and
a private CA for a deployment that has none (`gpucloud up --tls`).

Servers (API, ledger, agents, tracker and origin, peers, simulated managers) all start through
`serve_options`: a certificate and key when TLS is configured, and a refusal to bind anything
but loopback without TLS unless the operator says `--insecure`.

Clients never build their own trust: every httpx client gets `client_verify()`, the public CAs
(certifi) plus the CAs this process was told to trust (`trust(path)`: each process passes the
deployment's `GPUCLOUD_TLS__CA_FILE` through `bootstrap.trust_configured_ca` as it starts, and
`gpucloud agent --ca-file` its own), so a certificate the private CA did not sign fails the
handshake, and no client turns verification off. This module reads no settings: its trust (CA)
and each server's certificate and key (`ServerTLS`) are handed to it.

`LocalCA` makes that private CA with the `cryptography` package: an ECDSA P-256 root (10 years)
and leaf certificates for the hosts given (1 year), keys 0600, kept in a folder so a second
start reuses them.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import threading
from pathlib import Path
from typing import Any

import certifi
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpucloud.config import ServerTLS, is_loopback, write_private
from gpucloud.web import buffers


class InsecureBind(SystemExit):
    """A server asked to listen off loopback without TLS."""


_lock = threading.Lock()
_ca_files: list[Path] = []
_context: ssl.SSLContext | None = None


def trust(ca_file: Path | None) -> None:
    """Verify servers against the public CAs plus `ca_file` (and any trusted before) in this
    process from now on."""
    global _context
    with _lock:
        if ca_file is not None and ca_file not in _ca_files:
            _ca_files.append(ca_file)
            _context = None


def client_verify() -> ssl.SSLContext:
    """What every client passes as httpx's `verify`: certifi's CAs plus the CAs trusted."""
    global _context
    with _lock:
        if _context is None:
            context = ssl.create_default_context(cafile=certifi.where())
            for ca_file in _ca_files:
                context.load_verify_locations(cafile=str(ca_file))
            _context = context
        return _context


# At a stop, requests in flight get this long to finish. Nor is an idle TLS connection waited on
# longer: asyncio gives the peer 30 s to answer a close (`ssl_shutdown_timeout`), and a client
# holding a keep-alive connection it is not reading answers never, so a server that waited would
# outlive its supervisor's stop timeout (and be killed) whenever a client was connected.
GRACEFUL_SHUTDOWN_S = 5


def serve_options(
    host: str,
    tls: ServerTLS | None,
    *,
    insecure: bool = False,
    what: str = "server",
    insecure_hint: str = "set GPUCLOUD_TLS__INSECURE=true",
) -> dict[str, Any]:
    """uvicorn's TLS options for a server on `host`; refuses a bind off loopback without TLS.
    Every gpucloud server is configured through here, so it also sets uvicorn's read buffer and
    bounds its graceful shutdown (`GRACEFUL_SHUTDOWN_S`)."""
    buffers.raise_server_read_buffer()
    bounded = {"timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_S}
    if tls is None:
        if not is_loopback(host) and not insecure:
            raise InsecureBind(
                f"the {what} would listen on {host} without TLS: give it a certificate "
                "(GPUCLOUD_TLS__CERT_FILE and GPUCLOUD_TLS__KEY_FILE, or `gpucloud up --tls`), bind it to "
                f"127.0.0.1, or {insecure_hint} on a network you trust"
            )
        return bounded
    return {**bounded, "ssl_certfile": str(tls.cert_file), "ssl_keyfile": str(tls.key_file)}


def scheme(tls: ServerTLS | None) -> str:
    return "https" if tls is not None else "http"


# A private CA ----------------------------------------------------------------------------------


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gpucloud"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _subject_alt_names(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


class LocalCA:
    """A private CA kept in `folder` (`ca.pem`, `ca.key`), made the first time."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.cert_file, self.key_file = folder / "ca.pem", folder / "ca.key"
        if not self.cert_file.exists():
            self._create()
        self._cert = x509.load_pem_x509_certificate(self.cert_file.read_bytes())
        key = serialization.load_pem_private_key(self.key_file.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{self.key_file} is not an EC private key")
        self._key = key

    def _create(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        name = _name("gpucloud local CA")
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        write_private(self.key_file, _pem_key(key))
        self.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, hosts: list[str], *, client: bool = False) -> ServerTLS:
        """A leaf certificate for `hosts` (`<name>.pem`, `<name>.key`), made if absent."""
        cert_file, key_file = self.folder / f"{name}.pem", self.folder / f"{name}.key"
        if cert_file.exists() and key_file.exists():
            return ServerTLS(cert_file, key_file)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usages = (
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            if client
            else [ExtendedKeyUsageOID.SERVER_AUTH]
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(hosts[0] if hosts else name))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_subject_alt_names(hosts), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        write_private(key_file, _pem_key(key))
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return ServerTLS(cert_file, key_file)
