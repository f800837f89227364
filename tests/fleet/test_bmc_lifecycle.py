"""Nodes driven out of band through their BMCs: the simulated fleet with the sushy-tools Redfish
emulator as every node's BMC (the fleet follows the emulator's power states), the control plane
acting through sushy. Bring-up discovers each system and powers it on; a host that stops
answering is pulled and power-cycled by the repair ladder and comes back through wipe and
burn-in; a BMC that refuses ends the node in a failure state that names the cause; operators
power nodes on, off and through a cycle, and a retired node is powered off."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
from pathlib import Path

import pytest

from gpucloud.sim.bmc import CREDENTIAL_REF
from support.stack import async_wait_until, settled_operation

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

BMC_SETTINGS = {
    "agent__heartbeat_timeout_s": 2.0,
    "bmc__power_cycle_after_s": 3.0,
    "bmc__power_wait_s": 30.0,
    "bmc__poll_s": 0.5,
    "bmc__boot_wait_s": 60.0,
}


class Heartbeats:
    """The fleet's agents report every half second, as long as their hosts run."""

    def __init__(self, harness) -> None:
        self.harness = harness
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.5):
            try:
                self.harness.push_heartbeats()
            except Exception as exc:  # a missed beat is what the tests are about, not an error
                self.errors.append(repr(exc))

    def __enter__(self) -> Heartbeats:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)


@contextlib.asynccontextmanager
async def bmc_fleet(make_harness, in_process_worker, db_url, *, nodes: int = 2, enroll: bool = True, **settings):
    """A harness whose simulated nodes have BMCs (the Redfish emulator), its worker, and agents
    heartbeating every half second; with `enroll`, the fleet enrolled, available and heard from."""
    h = make_harness(db_url, nodes=nodes, latency_scale=0.02, bmc=True, **{**BMC_SETTINGS, **settings})
    await in_process_worker(h.settings)
    with Heartbeats(h) as beats:
        if enroll:
            h.enroll_fleet()
            await h.wait_states({"available": nodes}, timeout_s=90)
            await async_wait_until(
                lambda: all(n["last_heartbeat_at"] for n in h.nodes()),
                timeout_s=10,
                what=f"heartbeats {beats.errors[-1:]}",
            )
        yield h


def _boot_id(h, node_id: str) -> str:
    return next(b["boot_id"] for b in h.sim.heartbeats() if b["node_id"] == node_id)


def _events(h, node_id: str) -> list[dict]:
    return h.operator.get(f"/v1/nodes/{node_id}/events", params={"page_size": 200}).json()["items"]


async def _sweep_until(h, client, predicate, *, timeout_s: float, what: str, node_id: str | None = None):
    """Sweep (as the schedule would, only sooner) until `predicate` holds."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = await h.sweep(client)
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.5)
    seen = (h.node(node_id), _events(h, node_id)[-6:]) if node_id else ""
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last sweep {last}; {seen}")


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_a_hung_host_is_power_cycled_through_its_bmc_and_returns_through_burn_in(
    db_url, make_harness, in_process_worker, temporal_env
):
    async with bmc_fleet(make_harness, in_process_worker, db_url) as h:
        node_id = h.nodes()[0]["id"]
        node = h.node(node_id)
        # Bring-up asked the BMC first: what the system is, and its power (already on).
        assert node["bmc_credential_ref"] == CREDENTIAL_REF and node["power_state"] == "On"
        assert node["hardware"]["manufacturer"] == "Sushy Emulator"
        assert {"bmc_discovered", "power_on"} <= {e["event"] for e in _events(h, node_id)}
        boot_before = _boot_id(h, node_id)

        h.sim.set_unreachable(node_id, True)  # the kernel hangs: no heartbeat, no answer; power stays on
        await _sweep_until(
            h,
            temporal_env.client,
            lambda: h.node(node_id)["state"] in ("repairing", "wiping", "burn_in"),
            timeout_s=60,
            what="the silent host pulled and its repair started",
            node_id=node_id,
        )
        await _sweep_until(
            h,
            temporal_env.client,
            lambda: h.node(node_id)["state"] == "available" and h.node(node_id)["agent_reachable"],
            timeout_s=120,
            what="the node back in the pool through wipe and burn-in",
            node_id=node_id,
        )
    events = _events(h, node_id)
    kinds = [e["event"] for e in events]
    cycle = next(e for e in events if e["event"] == "power_cycle")
    assert "ForceOff accepted" in cycle["cause"] and "On accepted" in cycle["cause"]  # the BMC's answer
    assert kinds.index("power_cycle") < max(i for i, k in enumerate(kinds) if k == "ok")  # then wipe, burn-in
    assert _boot_id(h, node_id) != boot_before  # the host rebooted


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_a_bmc_that_refuses_ends_the_node_in_a_failure_state_naming_the_cause(
    db_url, make_harness, in_process_worker, temporal_env
):
    async with bmc_fleet(make_harness, in_process_worker, db_url) as h:
        node_id = h.nodes()[1]["id"]
        # The BMC's password was changed behind the control plane's back.
        (h.settings.bmc_credentials_dir / CREDENTIAL_REF).write_text("admin:not-the-password")
        h.sim.set_unreachable(node_id, True)
        await _sweep_until(
            h,
            temporal_env.client,
            lambda: h.node(node_id)["state"] == "rma",
            timeout_s=90,
            what="the node in RMA",
            node_id=node_id,
        )
    node = h.node(node_id)
    assert node["bmc_last"]["ok"] is False and node["bmc_last"]["kind"] == "auth"
    moved = next(e for e in _events(h, node_id) if e["to_state"] == "rma")
    assert "refused the credentials" in moved["cause"], moved
    assert h.nodes(state="available")[0]["id"] != node_id  # the other node is untouched


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_operators_power_nodes_through_their_bmcs_and_a_retired_node_is_powered_off(
    db_url, make_harness, in_process_worker, temporal_env
):
    async with bmc_fleet(make_harness, in_process_worker, db_url) as h:
        node_id = h.nodes()[0]["id"]

        answer = h.operator.post(f"/v1/nodes/{node_id}/power", json={"action": "off", "reason": "cabling"})
        assert answer.status_code == 202, answer.text
        op = answer.json()["operation"]
        done = await async_wait_until(
            lambda: settled_operation(h.operator, op["id"]),
            timeout_s=60,
            what=f"power off {h.node(node_id)} {_events(h, node_id)[-3:]}",
        )
        assert done["status"] == "succeeded", done
        assert h.node(node_id)["power_state"] == "Off"
        await async_wait_until(lambda: h.sim.node(node_id)["unreachable"], timeout_s=10, what="the host stopped")

        answer = h.operator.post(f"/v1/nodes/{node_id}/power", json={"action": "on"})
        op = answer.json()["operation"]
        done = await async_wait_until(lambda: settled_operation(h.operator, op["id"]), timeout_s=60, what="on")
        assert done["status"] == "succeeded", done
        await async_wait_until(lambda: not h.sim.node(node_id)["unreachable"], timeout_s=20, what="the host booted")
        events = {e["event"]: e for e in _events(h, node_id)}
        assert (
            events["power_off_requested"]["actor"] == "operator:bootstrap" and "cabling" in events["power_off"]["cause"]
        )

        assert h.operator.post(f"/v1/nodes/{node_id}/power", json={"action": "reboot"}).status_code == 422
        assert h.operator.post("/v1/nodes/no-such-node/power", json={"action": "on"}).status_code == 404
        plain = {**h.sim.inventory()[1], "id": f"{h.sim.id_prefix}-no-bmc"}
        for field in ("bmc_url", "bmc_system_id", "bmc_credential_ref"):
            plain.pop(field)
        h.operator.post("/v1/nodes:enroll", json={"nodes": [plain]}).raise_for_status()
        refused = h.operator.post(f"/v1/nodes/{plain['id']}/power", json={"action": "on"})
        assert refused.status_code == 409 and "has no BMC" in refused.json()["detail"], refused.text

        # The CLI: the same action, waited for, and the power column of `gpucloud nodes`.
        from typer.testing import CliRunner

        from gpucloud.cli.main import app

        env = {
            "GPUCLOUD_API__PORT": str(h.settings.api.port),
            "GPUCLOUD_API__OPERATOR_TOKEN": h.settings.operator_token,
            "COLUMNS": "200",
        }
        cycled = await asyncio.to_thread(
            CliRunner().invoke, app, ["node", "power", node_id, "cycle", "--reason", "cli"], env=env
        )
        assert cycled.exit_code == 0 and "power On" in cycled.output and "succeeded" in cycled.output, cycled.output
        listed = await asyncio.to_thread(CliRunner().invoke, app, ["nodes"], env=env)
        assert listed.exit_code == 0 and "power" in listed.output and "On" in listed.output, listed.output

        # Retire: out of the fleet, and powered off through its BMC. The cycle ends when the power
        # is on; the host then boots for a few seconds, and a drain meanwhile would find its agent
        # silent and send the node through repair instead.
        await async_wait_until(lambda: not h.sim.node(node_id)["unreachable"], timeout_s=20, what="the host booted")
        assert h.operator.post(f"/v1/nodes/{node_id}/drain").status_code == 202
        await _sweep_until(
            h, temporal_env.client, lambda: h.node(node_id)["state"] == "quarantined", timeout_s=60, what="drained"
        )
        assert h.operator.post(f"/v1/nodes/{node_id}/retire", json={"reason": "end of life"}).status_code == 200
        await async_wait_until(
            lambda: h.node(node_id)["power_state"] == "Off", timeout_s=60, what="the retired node off"
        )
        assert h.node(node_id)["state"] == "retired"


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_a_missing_system_and_a_bmc_that_never_resets_end_in_named_failure_states(
    db_url, make_harness, in_process_worker, temporal_env
):
    from support.faulty_http import FaultyProxy

    fleet = bmc_fleet(make_harness, in_process_worker, db_url, nodes=3, enroll=False, bmc__power_wait_s=4.0)
    async with fleet as h:
        inventory = h.sim.inventory()
        missing, stuck = inventory[0], inventory[1]
        missing["bmc_system_id"] = "00000000-0000-0000-0000-000000000000"  # a typo in the enrollment file
        with FaultyProxy(stuck["bmc_url"]) as proxy:
            stuck["bmc_url"] = proxy.url  # a BMC that accepts a reset and never changes the power state
            proxy.mode = "swallow_resets"
            assert h.operator.post("/v1/nodes:enroll", json={"nodes": inventory}).status_code in (200, 201, 202)
            await h.wait_states({"available": 2, "quarantined": 1}, timeout_s=90)
            quarantined = h.node(missing["id"])
            assert quarantined["state"] == "quarantined" and quarantined["bmc_last"]["kind"] == "not_found"
            moved = next(e for e in _events(h, missing["id"]) if e["to_state"] == "quarantined")
            assert "no such system" in moved["cause"], moved

            await async_wait_until(lambda: h.node(stuck["id"])["last_heartbeat_at"], timeout_s=10, what="heartbeats")
            h.sim.set_unreachable(stuck["id"], True)
            await _sweep_until(
                h,
                temporal_env.client,
                lambda: h.node(stuck["id"])["state"] == "rma",
                timeout_s=120,
                what="the node whose BMC never resets in RMA",
                node_id=stuck["id"],
            )
    assert h.node(stuck["id"])["bmc_last"]["kind"] == "stuck"
    moved = next(e for e in _events(h, stuck["id"]) if e["to_state"] == "rma")
    assert "accepted ForceOff but the power state is still On" in moved["cause"], moved


@contextlib.asynccontextmanager
async def _reimaging_fleet(make_harness, in_process_worker, db_url, tmp_path: Path):
    """A BMC fleet whose cleaning boots a known image, served over loopback, and a tenant."""
    from support.faulty_http import FileServer

    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "clean.iso").write_bytes(b"gpucloud clean image v1")
    digest = hashlib.sha256(b"gpucloud clean image v1").hexdigest()
    with FileServer(str(tmp_path / "images")) as images:
        image = {"bmc__clean_image_url": images.url("clean.iso"), "bmc__clean_image_sha256": digest}
        async with bmc_fleet(make_harness, in_process_worker, db_url, **image) as h:
            yield h, digest


async def _allocate_one(h) -> tuple[str, str, str]:
    _, key = await h.onboard()
    alloc_id = h.allocate(key, node_count=1)
    ready = await h.wait_allocation(key, alloc_id, "ready", timeout_s=60)
    return key, alloc_id, ready["node_ids"][0]


def _cancel(h, key: str, alloc_id: str) -> None:
    with h.client(key) as c:
        assert c.post(f"/v1/allocations/{alloc_id}/cancel").status_code == 202


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_a_released_node_is_reimaged_out_of_band_and_returns_only_through_burn_in(
    db_url, make_harness, in_process_worker, tmp_path
):
    async with _reimaging_fleet(make_harness, in_process_worker, db_url, tmp_path) as (h, digest):
        key, alloc_id, node_id = await _allocate_one(h)
        boot_before, held = h.sim.node(node_id)["boot_id"], h.sim.client.credential(node_id)
        _cancel(h, key, alloc_id)
        await h.wait_allocation(key, alloc_id, "released", timeout_s=90)
        await async_wait_until(
            lambda: h.node(node_id)["state"] in ("available", "quarantined"), timeout_s=90, what="the node cleaned"
        )
        events = _events(h, node_id)
        assert h.node(node_id)["state"] == "available", events[-6:]
        kinds = [e["event"] for e in events]
        # Insert + one-time boot, power cycle, the booted image checked, then (only then) the
        # one-time enrollment token in the image's config drive, redeemed by the booted agent;
        # then the wipe (which hands no credential) and burn-in.
        steps = ("image_inserted", "power_cycle", "image_verified", "enrollment_handed", "agent_enrolled")
        inserted, cycled, verified, handed, enrolled = (kinds.index(k) for k in steps)
        to_burn_in = max(i for i, e in enumerate(events) if e["to_state"] == "burn_in")
        assert inserted < cycled < verified < handed < enrolled < to_burn_in == len(events) - 2, [
            (e["event"], e["to_state"]) for e in events
        ]
        assert "config drive inserted in Floppy" in events[handed]["cause"], events[handed]
        assert "redeemed its one-time enrollment token" in events[enrolled]["cause"]
        assert "Floppy ejected" in events[enrolled]["cause"], events[enrolled]
        assert "inserted in Cd; boot override Cd" in events[inserted]["cause"]
        assert f"booted sha256:{digest}" in events[verified]["cause"] and "Cd ejected" in events[verified]["cause"]
        assert events[-1]["to_state"] == "available" and events[-2]["to_state"] == "burn_in"
        assert "inband_wipe_only" not in kinds
        sim = h.sim.node(node_id)
        # The new credential went to the checked boot through its config drive, not the wipe.
        assert h.sim.client.credential(node_id) != held
        assert h.sim.node(node_id)["credential_from"] == "config_drive"
        assert sim["boot_id"] != boot_before and sim["image_digest"] == f"sha256:{digest}"


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_a_stand_in_agent_that_lies_about_its_image_ends_quarantined(
    db_url, make_harness, in_process_worker, tmp_path
):
    async with _reimaging_fleet(make_harness, in_process_worker, db_url, tmp_path) as (h, digest):
        key, alloc_id, node_id = await _allocate_one(h)
        h.sim.drift(node_id, "replace_agent")  # the tenant, root on the node, replaces the agent
        held = h.sim.client.credential(node_id)
        _cancel(h, key, alloc_id)
        await async_wait_until(
            lambda: h.node(node_id)["state"] in ("available", "quarantined"), timeout_s=90, what="the node cleaned"
        )
        events = _events(h, node_id)
        assert h.node(node_id)["state"] == "quarantined", events[-6:]
        mismatch = next(e for e in events if e["event"] == "image_mismatch")
        assert f"not the clean image sha256:{digest}" in mismatch["cause"]
        quarantined = next(e for e in events if e["to_state"] == "quarantined")
        assert "re-image check failed" in quarantined["cause"] and quarantined["from_state"] == "wiping"
        # Fails closed: no wipe handed the stand-in a credential, and the node never reached burn-in
        # after the allocation.
        assert h.sim.client.credential(node_id) == held
        assert all(e["to_state"] != "burn_in" for e in events[events.index(mismatch) :])
