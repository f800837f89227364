"""The one Temporal client factory (pydantic data converter), used by workers, API, CLI and tests."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from gpucloud.config import TemporalSettings


async def connect(settings: TemporalSettings) -> Client:
    return await Client.connect(settings.address, namespace=settings.namespace, data_converter=pydantic_data_converter)
