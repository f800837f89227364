"""The one place gpucloud builds an httpx client: `http_client` and `async_http_client`.

Every client gets its timeout from one table (`TIMEOUTS`, by what it talks to), so how long any
hop may take is read in one place; a caller with its own `timeout_s` option keeps the named
timeout's connect limit. TLS trust is an argument, never looked up here: callers pass what
`gpucloud.web.tls.client_verify()` gives (or a CA file), and no client turns verification off.
The factory reads no settings, so it builds the same client in a test as in production.

Tracing needs nothing here: `gpucloud.observability.tracing.configure` instruments httpx once
per process, which covers every client these functions build (`traceparent` on each request).
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from typing import Literal, NamedTuple

import httpx

TimeoutName = Literal[
    "agent_action",
    "agent_lookup",
    "agent_report",
    "agent_report_batch",
    "api",
    "bmc",
    "fabric_manager",
    "fabric_manager_setup",
    "ledger",
    "ledger_seed",
    "peer",
    "readiness",
    "simulator",
    "tracker",
]


class NamedTimeout(NamedTuple):
    seconds: float  # connect, read, write and pool, unless `connect_s` caps the connect
    connect_s: float | None = None


TIMEOUTS: Mapping[TimeoutName, NamedTimeout] = {
    # The control plane to a node's agent: an action (a wipe, a burn-in) answers when it is done.
    "agent_action": NamedTimeout(600.0, connect_s=5.0),
    # A (simulated) agent's short calls to the control plane: redeem an enrollment token, ask
    # which allocation holds its node.
    "agent_lookup": NamedTimeout(10.0),
    # An agent's reports to the control plane (enrollment, heartbeats, XID events, readings),
    # a real node's or a simulated one's.
    "agent_report": NamedTimeout(30.0),
    # The simulated fleet's enrollment and heartbeats, in batches of hundreds of nodes.
    "agent_report_batch": NamedTimeout(60.0),
    # A caller of the public API (the typed client behind the CLI, the demo and the tests).
    "api": NamedTimeout(30.0, connect_s=10.0),
    # A node's BMC (Redfish).
    "bmc": NamedTimeout(10.0),
    # UFM, NMX-M and the SDN controller.
    "fabric_manager": NamedTimeout(10.0, connect_s=5.0),
    # The simulated NMX-M told which GPUs each NVL72 domain has (once, when a fleet is set up).
    "fabric_manager_setup": NamedTimeout(30.0),
    # The ledger service, and the control plane's ledger-token endpoint for an agent.
    "ledger": NamedTimeout(30.0),
    # The local stack (`gpucloud up`) seeding the ledger's price book once it is ready.
    "ledger_seed": NamedTimeout(10.0),
    # A node fetching weight chunks from its peers and the origin: a whole chunk per request.
    "peer": NamedTimeout(60.0, connect_s=5.0),
    # The local stack's readiness probe of a server it started (`/healthz`), asked again and again.
    "readiness": NamedTimeout(1.0),
    # The simulated fleet's own endpoints (its nodes' reports, fault and outage injection).
    "simulator": NamedTimeout(10.0),
    # The weights tracker and origin (a node's plans and announcements, the control plane's swarms).
    "tracker": NamedTimeout(30.0),
}

# What a client verifies servers against: an SSL context (`tls.client_verify()`) or a CA file.
Trust = ssl.SSLContext | str | os.PathLike[str]


def timeout_for(name: TimeoutName, *, seconds: float | None = None) -> httpx.Timeout:
    """The named timeout; `seconds` replaces its total, under the same connect limit."""
    named = TIMEOUTS[name]
    total = named.seconds if seconds is None else seconds
    connect = total if named.connect_s is None else min(named.connect_s, total)
    return httpx.Timeout(total, connect=connect)


def ssl_context(trust: Trust) -> ssl.SSLContext:
    """What httpx verifies servers against: the context given, or one trusting the CA file given."""
    if isinstance(trust, ssl.SSLContext):
        return trust
    if isinstance(trust, (str, os.PathLike)):
        return ssl.create_default_context(cafile=os.fspath(trust))
    raise TypeError(f"trust is an ssl.SSLContext or a CA file, not {trust!r}: no client turns verification off")


def _options(
    *,
    timeout: TimeoutName,
    trust: Trust,
    timeout_s: float | None,
    base_url: str,
    headers: Mapping[str, str] | None,
    auth: httpx.Auth | tuple[str, str] | None,
    limits: httpx.Limits | None,
) -> dict:
    options: dict = {
        "base_url": base_url,
        "timeout": timeout_for(timeout, seconds=timeout_s),
        "verify": ssl_context(trust),
        "headers": headers,
        "auth": auth,
    }
    if limits is not None:
        options["limits"] = limits
    return options


def http_client(
    *,
    timeout: TimeoutName,
    trust: Trust,
    timeout_s: float | None = None,
    base_url: str = "",
    headers: Mapping[str, str] | None = None,
    auth: httpx.Auth | tuple[str, str] | None = None,
    limits: httpx.Limits | None = None,
    transport: httpx.BaseTransport | None = None,
) -> httpx.Client:
    """A blocking client with the named timeout (`timeout_s` overriding its total) that verifies
    servers against `trust`. `transport` answers in tests."""
    options = _options(
        timeout=timeout, trust=trust, timeout_s=timeout_s, base_url=base_url, headers=headers, auth=auth, limits=limits
    )
    return httpx.Client(transport=transport, **options)


def async_http_client(
    *,
    timeout: TimeoutName,
    trust: Trust,
    timeout_s: float | None = None,
    base_url: str = "",
    headers: Mapping[str, str] | None = None,
    auth: httpx.Auth | tuple[str, str] | None = None,
    limits: httpx.Limits | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> httpx.AsyncClient:
    """The asyncio twin of `http_client`."""
    options = _options(
        timeout=timeout, trust=trust, timeout_s=timeout_s, base_url=base_url, headers=headers, auth=auth, limits=limits
    )
    return httpx.AsyncClient(transport=transport, **options)
