"""Read sizes of the HTTP stacks gpucloud serves and calls with, raised for bulk transfers.

Model weights move as chunk bodies of up to 64 MiB. uvicorn pauses reading a connection as soon
as 64 KiB of its body wait for the app, and httpcore reads a response 64 KiB at a time; each of
those pieces then goes once through the event loop and every middleware (server side) or through
h11's receive buffer (client side), which on a 2-core machine cost more CPU than the bytes
themselves. At 1 MiB that cost is paid a sixteenth as often (`benchmarks/chunking.py`: push over
the API 0.148 -> 0.187 GB/s on the same disk). Neither library takes these as settings: they are
a module constant and a class attribute, set here, and `tests/api/test_web_buffers.py` fails if
an upgrade renames them.

A connection holds at most about `READ_SIZE` of unread body, so memory stays bounded by the
number of connections admitted.
"""

from __future__ import annotations

READ_SIZE = 1 << 20


def raise_server_read_buffer() -> None:
    """Let uvicorn buffer up to `READ_SIZE` of a request body before it pauses reading."""
    from uvicorn.protocols.http import flow_control, h11_impl, httptools_impl

    for module in (flow_control, h11_impl, httptools_impl):  # the latter two import it by name
        module.HIGH_WATER_LIMIT = max(flow_control.HIGH_WATER_LIMIT, READ_SIZE)  # type: ignore[attr-defined]


def raise_client_read_size() -> None:
    """Let httpcore read up to `READ_SIZE` of a response at a time."""
    from httpcore._sync.http11 import HTTP11Connection

    HTTP11Connection.READ_NUM_BYTES = max(HTTP11Connection.READ_NUM_BYTES, READ_SIZE)
