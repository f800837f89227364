"""The HTTP stacks' read sizes that `gpucloud.web.buffers` raises still exist where it sets them,
and a server configured the gpucloud way, and a gpucloud client, use them."""

from __future__ import annotations

import httpcore._sync.http11 as client_http11
import pytest
from uvicorn.protocols.http import flow_control, h11_impl, httptools_impl

from gpucloud.client.base import ApiClient
from gpucloud.web import buffers, tls

pytestmark = pytest.mark.unit


def test_a_gpucloud_server_buffers_a_mebibyte_of_body_before_it_pauses_reading() -> None:
    assert flow_control.HIGH_WATER_LIMIT >= 64 * 1024  # the constant uvicorn defines
    tls.serve_options("127.0.0.1", None, what="test")
    for module in (flow_control, h11_impl, httptools_impl):
        assert module.HIGH_WATER_LIMIT == buffers.READ_SIZE, module.__name__


def test_a_gpucloud_client_reads_responses_a_mebibyte_at_a_time() -> None:
    with ApiClient("http://127.0.0.1:9", "token"):
        pass
    assert client_http11.HTTP11Connection.READ_NUM_BYTES == buffers.READ_SIZE
