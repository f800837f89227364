"""The one client of the simulated fleet's own endpoints: what its nodes report, and the faults,
drift and outages tests, the demo and the benchmarks inject. (The control plane reaches the
simulated agents through `gpucloud.adapters.host_agent`, as it reaches real ones.)"""

from __future__ import annotations

from typing import Any

import httpx

from gpucloud.web import tls
from gpucloud.web.http_client import http_client
from gpucloud.web.service_tokens import Issuer, agent_audience


class SimFleetClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        issuer: Issuer | None = None,
        token: str | None = None,
    ) -> None:
        """`token`: the operator token, which the simulator's own endpoints ask for."""
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self.http = http_client(
            base_url=base_url.rstrip("/"),
            timeout="simulator",
            timeout_s=timeout_s,
            transport=transport,
            headers=headers,
            trust=tls.client_verify(),
        )
        # Signs the calls a node's agent takes only from the control plane (its weights API).
        self._issuer = issuer

    def __enter__(self) -> SimFleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.http.request(method, path, **kwargs)
        response.raise_for_status()
        return response.json()

    def node(self, node_id: str) -> dict[str, Any]:
        """What the node's agent reports: state, tenant, allocation, boot id, faults."""
        return self._call("GET", f"/v1/nodes/{node_id}")

    def credential(self, node_id: str) -> str:
        """The agent credential the node's last wipe handed over (what a real agent keeps on disk)."""
        return self._call("GET", f"/v1/nodes/{node_id}/credential")["credential"]

    def faults(self) -> dict[str, Any]:
        """What the fleet's fault model injected (`--faults`), by category and by node."""
        return self._call("GET", "/v1/faults")

    def run_faults(
        self, running: bool = True, *, minimum_per_category: int = 0, over_fleet_s: float | None = None
    ) -> dict[str, Any]:
        """Start (or pause) the fleet's fault model; with `minimum_per_category`, at least that
        many faults of every category within the next `over_fleet_s` of fleet time."""
        body: dict[str, Any] = {"running": running}
        if minimum_per_category:
            body |= {"minimum_per_category": minimum_per_category, "over_fleet_s": over_fleet_s}
        return self._call("PUT", "/v1/faults/running", json=body)

    def inventory(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/inventory")

    def heartbeats(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/heartbeats")

    def metering(self) -> dict[str, Any]:
        """Each node's metered allocations and intervals, and how far its spool is behind."""
        return self._call("GET", "/v1/metering")

    def drift(self, node_id: str, kind: str) -> dict[str, Any]:
        """`reboot` or `wipe` the node behind the control plane's back (`AgentAction`), or
        `replace_agent` with a stand-in that lies about the image it booted."""
        return self._call("POST", f"/v1/nodes/{node_id}/drift", json={"kind": kind})

    def set_unreachable(self, node_id: str, unreachable: bool = True) -> dict[str, Any]:
        return self._call("POST", f"/v1/nodes/{node_id}/reachability", json={"unreachable": unreachable})

    def hardware_fault(self, node_id: str, fault: str | None, *, fixed_by: str | None = None) -> dict[str, Any]:
        return self._call("POST", f"/v1/nodes/{node_id}/hardware_fault", json={"fault": fault, "fixed_by": fixed_by})

    def inject(self, node_id: str, action: str, mode: str, count: int = 1) -> dict[str, Any]:
        """Make the node's next `count` `action` calls fail, `transient`ly or `permanent`ly."""
        body = {"node_id": node_id, "action": action, "mode": mode, "count": count}
        return self._call("POST", "/v1/faults", json=body)

    def switch_down(self, switch_id: str) -> dict[str, Any]:
        """Fail a leaf switch: its nodes' fabric links go down together and each reports them."""
        return self._call("POST", "/v1/faults/switch_down", json={"switch_id": switch_id})

    def switch_up(self, switch_id: str) -> dict[str, Any]:
        return self._call("POST", "/v1/faults/switch_up", json={"switch_id": switch_id})

    def weights_status(self, node_id: str) -> dict[str, Any]:
        """The versions on the node: active, previous, cached."""
        return self._call("GET", f"/v1/nodes/{node_id}/weights/status", headers=self._auth(node_id))

    def verify_weights(self, node_id: str, digest: str) -> dict[str, Any]:
        """Re-hash every file of the version on the node against its signed manifest."""
        return self._call(
            "POST",
            f"/v1/nodes/{node_id}/weights/verify",
            json={"digest": digest},
            timeout=60,
            headers=self._auth(node_id),
        )

    def _auth(self, node_id: str) -> dict[str, str]:
        if self._issuer is None:
            return {}
        return {"Authorization": f"Bearer {self._issuer.mint(agent_audience(node_id))}"}
