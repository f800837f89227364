"""Blocking httpx clients for the three fabric managers, and `HttpFabricController` over them.

Pointed at the simulated managers (`gpucloud.sim.fabric_managers`) in tests and `gpucloud up`;
the real adapters point them at UFM, NMX-M and the SDN controller (each with its own token,
sent on its calls only, over the shared `httpx.Client`). A 4xx becomes `FabricError` carrying the constraint the
manager names; a 404 on a read becomes `None`; transport errors and 5xx propagate as httpx
errors, which callers (activities) treat as transient and retry.
"""

from __future__ import annotations

from typing import Any

import httpx

from gpucloud.fabric.interface import FabricError, FabricTokens, Membership, NvlPartition, PKey, Vpc
from gpucloud.web import tls
from gpucloud.web.http_client import http_client


def _raise_for_refusal(response: httpx.Response) -> None:
    if response.is_client_error:
        try:
            detail = response.json()["detail"]
            constraint, message = detail["constraint"], detail["message"]
        except (ValueError, KeyError, TypeError):
            constraint, message = "unknown", response.text
        raise FabricError(response.status_code, constraint, message)
    response.raise_for_status()


def _call(client: httpx.Client, auth: dict[str, str], method: str, url: str, **kwargs: Any) -> httpx.Response:
    response = client.request(method, url, headers=auth, **kwargs)
    _raise_for_refusal(response)
    return response


def _get_or_none(client: httpx.Client, auth: dict[str, str], url: str, **kwargs: Any) -> httpx.Response | None:
    response = client.get(url, headers=auth, **kwargs)
    if response.status_code == 404:
        return None
    _raise_for_refusal(response)
    return response


def _bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _pkey(body: dict) -> PKey:
    # One validation of the whole record: the default partition holds every port of the fleet.
    return PKey.model_validate(
        {"pkey": int(body["pkey"], 16), "name": body.get("name", ""), "members": body.get("guids", ())}
    )


class UfmClient:
    """UFM's PKey REST API (`/ufmRest/resources/pkeys`); pkeys travel as hex strings."""

    def __init__(self, client: httpx.Client, base_url: str, *, token: str | None = None) -> None:
        self._client = client
        self._auth = _bearer(token)
        self._base = f"{base_url.rstrip('/')}/ufmRest/resources/pkeys"

    def create_pkey(self, pkey: int, *, name: str) -> PKey:
        body = {"pkey": f"0x{pkey:04x}", "name": name}
        return _pkey(_call(self._client, self._auth, "POST", f"{self._base}/add", json=body).json())

    def add_ports(self, pkey: int, guids: list[str], *, membership: Membership) -> None:
        body = {"pkey": f"0x{pkey:04x}", "guids": guids, "membership": membership.value}
        _call(self._client, self._auth, "POST", self._base, json=body)

    def remove_ports(self, pkey: int, guids: list[str]) -> None:
        _call(self._client, self._auth, "DELETE", f"{self._base}/0x{pkey:04x}/guids/{','.join(guids)}")

    def get_pkey(self, pkey: int) -> PKey | None:
        response = _get_or_none(self._client, self._auth, f"{self._base}/0x{pkey:04x}")
        return None if response is None else _pkey(response.json())

    def list_pkeys(self, *, members: bool = False) -> list[PKey]:
        """Every pkey; without `members` their names only (UFM lists GUIDs on `guids_data=true`)."""
        params = {"guids_data": "true"} if members else None
        return [
            _pkey(body) for body in _call(self._client, self._auth, "GET", self._base, params=params).json().values()
        ]

    def delete_pkey(self, pkey: int) -> None:
        _call(self._client, self._auth, "DELETE", f"{self._base}/0x{pkey:04x}")


class NmxClient:
    """NMX-M's partition API (`/nmx/v1/partitions`)."""

    def __init__(self, client: httpx.Client, base_url: str, *, token: str | None = None) -> None:
        self._client = client
        self._auth = _bearer(token)
        self._base = f"{base_url.rstrip('/')}/nmx/v1"

    def register_domain(self, domain_id: str, gpu_uids: list[str]) -> None:
        """Simulator only: real NMX-M discovers a domain's GPUs itself."""
        _call(self._client, self._auth, "PUT", f"{self._base}/domains/{domain_id}", json={"gpu_uids": gpu_uids})

    def create_partition(self, *, name: str, domain_id: str, gpu_uids: list[str]) -> NvlPartition:
        body = {"name": name, "domain_id": domain_id, "gpu_uids": gpu_uids}
        response = _call(self._client, self._auth, "POST", f"{self._base}/partitions", json=body)
        return NvlPartition.model_validate(response.json())

    def update_partition(self, partition_id: int, *, gpu_uids: list[str]) -> NvlPartition:
        """Replace the partition's GPUs (a tray joins or leaves a slice)."""
        response = _call(
            self._client, self._auth, "PUT", f"{self._base}/partitions/{partition_id}", json={"gpu_uids": gpu_uids}
        )
        return NvlPartition.model_validate(response.json())

    def get_partition(self, partition_id: int) -> NvlPartition | None:
        response = _get_or_none(self._client, self._auth, f"{self._base}/partitions/{partition_id}")
        return None if response is None else NvlPartition.model_validate(response.json())

    def list_partitions(self, *, domain_id: str | None = None) -> list[NvlPartition]:
        params = {} if domain_id is None else {"domain_id": domain_id}
        response = _call(self._client, self._auth, "GET", f"{self._base}/partitions", params=params)
        return [NvlPartition.model_validate(p) for p in response.json()]

    def delete_partition(self, partition_id: int) -> None:
        _call(self._client, self._auth, "DELETE", f"{self._base}/partitions/{partition_id}")


class SdnClient:
    """The SDN controller's VPC API (`/sdn/v1/vpcs`)."""

    def __init__(self, client: httpx.Client, base_url: str, *, token: str | None = None) -> None:
        self._client = client
        self._auth = _bearer(token)
        self._base = f"{base_url.rstrip('/')}/sdn/v1/vpcs"

    def create_vpc(self, *, tenant_id: str, vni: int | None = None) -> Vpc:
        body = {"tenant_id": tenant_id, "vni": vni}
        return Vpc.model_validate(_call(self._client, self._auth, "POST", self._base, json=body).json())

    def get_vpc(self, vni: int) -> Vpc | None:
        response = _get_or_none(self._client, self._auth, f"{self._base}/{vni}")
        return None if response is None else Vpc.model_validate(response.json())

    def list_vpcs(self, *, tenant_id: str | None = None) -> list[Vpc]:
        params = {} if tenant_id is None else {"tenant_id": tenant_id}
        return [Vpc.model_validate(v) for v in _call(self._client, self._auth, "GET", self._base, params=params).json()]

    def attach(self, vni: int, node_id: str) -> Vpc:
        return Vpc.model_validate(_call(self._client, self._auth, "PUT", f"{self._base}/{vni}/nodes/{node_id}").json())

    def detach(self, vni: int, node_id: str) -> Vpc:
        return Vpc.model_validate(
            _call(self._client, self._auth, "DELETE", f"{self._base}/{vni}/nodes/{node_id}").json()
        )

    def delete_vpc(self, vni: int) -> None:
        _call(self._client, self._auth, "DELETE", f"{self._base}/{vni}")


class HttpFabricController:
    """The three clients over one connection pool; each manager may have its own base URL."""

    def __init__(
        self,
        *,
        ufm_url: str,
        nmx_url: str,
        sdn_url: str,
        tokens: FabricTokens | None = None,
        timeout_s: float = 10.0,
        client: httpx.Client | None = None,
    ) -> None:
        """`tokens`: each manager's own API token, sent as a bearer token on its calls only."""
        self._client = client or http_client(timeout="fabric_manager", timeout_s=timeout_s, trust=tls.client_verify())
        self._owns_client = client is None
        ufm, nmx, sdn = tokens or (None, None, None)
        self._infiniband = UfmClient(self._client, ufm_url, token=ufm)
        self._nvlink = NmxClient(self._client, nmx_url, token=nmx)
        self._ethernet = SdnClient(self._client, sdn_url, token=sdn)

    @classmethod
    def for_simulator(cls, url: str, **options: Any) -> HttpFabricController:
        """All three managers at one URL, as `gpucloud.sim.fabric_managers` serves them."""
        return cls(ufm_url=url, nmx_url=url, sdn_url=url, **options)

    @property
    def infiniband(self) -> UfmClient:
        return self._infiniband

    @property
    def nvlink(self) -> NmxClient:
        return self._nvlink

    @property
    def ethernet(self) -> SdnClient:
        return self._ethernet

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> HttpFabricController:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
