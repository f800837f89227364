"""The one S3 the tests talk to: moto's server over real HTTP (the `s3_endpoint` fixture in
`tests/conftest.py`), and a fresh bucket per test in it (moto keeps one in-memory S3 per
process, so buckets keep the tests apart)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import boto3
from moto.server import ThreadedMotoServer

CREDENTIALS = {"region_name": "us-east-1", "aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


@contextmanager
def moto_server() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def s3_client(endpoint: str) -> Any:
    return boto3.client("s3", endpoint_url=endpoint, **CREDENTIALS)


def new_bucket(endpoint: str, prefix: str = "test") -> tuple[Any, str]:
    """A client and the name of a bucket made for this test alone."""
    client = s3_client(endpoint)
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    return client, name
