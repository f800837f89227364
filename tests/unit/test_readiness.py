"""`/readyz`'s Temporal check: the frontend's health every probe; the namespace and the search
attributes only until they are found once (registered, they stay), since every load balancer
probes every few seconds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpucloud.web.readiness import temporal_check
from gpucloud.workflows import search_attributes


class FakeTemporal:
    def __init__(self, attributes: set[str]) -> None:
        self.namespace, self.attributes, self.listed, self.health_checks = "default", attributes, 0, 0
        self.service_client = SimpleNamespace(
            check_health=self._health, operator_service=SimpleNamespace(list_search_attributes=self._list)
        )

    async def _health(self, **_options) -> bool:
        self.health_checks += 1
        return True

    async def _list(self, request):
        self.listed += 1
        return SimpleNamespace(custom_attributes=dict.fromkeys(self.attributes, 1))


async def test_the_search_attributes_are_listed_until_found_then_only_health_is_checked():
    temporal = FakeTemporal(set())
    check = temporal_check(lambda: temporal)
    with pytest.raises(RuntimeError, match="run `gpucloud prepare`"):
        await check()
    temporal.attributes = {key.name for key in search_attributes.ALL}
    for _ in range(3):
        await check()
    assert (temporal.listed, temporal.health_checks) == (2, 4)
