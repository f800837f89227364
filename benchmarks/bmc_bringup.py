"""Bring-up through the nodes' BMCs: the same fleet, the same stack, the same run, in three groups
of equal size enrolled one after the other:

- `no_bmc`: enrolled without a BMC (bring-up talks to the agents only);
- `bmc_on`: with a BMC whose system is already on (discovery and a power read, then bring-up);
- `bmc_off`: with a BMC whose system was powered off first: power on through Redfish, the host
  boots (the simulated fleet's `--boot-s`), its agent's first heartbeat is awaited, then bring-up.

Real stack: Temporal dev server, worker, API, the simulated fleet and the sushy-tools Redfish
emulator as separate processes, SQLite. The emulator applies each power change 1 to 11 s after
it is asked (on purpose, like hardware), so `bmc_off` is bounded below by that delay plus the
boot, whatever the control plane does; `bmc_off_floor_s` is that floor (11 s + boot).

    python benchmarks/bmc_bringup.py [--nodes N] [--quick]

Prints progress to stderr and one JSON line of figures last on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import threading
import time
from pathlib import Path

import httpx
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_stack, log

from gpucloud.devstack.stack import free_port
from gpucloud.sim.bmc import USERNAME, sim_bmc_password, system_id_of

BOOT_S = 3.0


def available(engine: sa.Engine, ids: list[str]) -> int:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, state FROM node")).all()
    wanted = set(ids)
    return sum(1 for node_id, state in rows if node_id in wanted and state == "available")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=150, help="three groups of a third each")
    parser.add_argument("--quick", action="store_true", help="30 nodes")
    args = parser.parse_args()
    nodes = 30 if args.quick else args.nodes
    group = nodes // 3

    settings, stack, data_dir = bench_stack(
        nodes, "memory", bmc={"emulator_port": free_port(), "poll_s": 0.5, "boot_wait_s": 300.0}
    )
    stack.bmc = True
    stop = threading.Event()
    try:
        log(f"starting stack (fleet with BMCs) in {data_dir}")
        stack.start(on_step=lambda s: log(f"  {s}"))
        api = httpx.Client(base_url=settings.api_url, headers={"Authorization": "Bearer bench-token"}, timeout=600)
        sim = httpx.Client(
            base_url=settings.sim_url, headers={"Authorization": f"Bearer {settings.operator_token}"}, timeout=600
        )
        inventory = sim.get("/v1/inventory").json()
        engine = sa.create_engine(settings.database_url)

        def heartbeats() -> None:  # the agents report every second (the bring-up of an off node awaits one)
            while not stop.wait(1.0):
                with contextlib.suppress(httpx.HTTPError):
                    api.post("/v1/agents/heartbeats", json={"heartbeats": sim.get("/v1/heartbeats").json()})

        threading.Thread(target=heartbeats, daemon=True).start()
        groups = {
            "no_bmc": inventory[:group],
            "bmc_on": inventory[group : 2 * group],
            "bmc_off": inventory[2 * group :],
        }
        for node in groups["no_bmc"]:
            for field in ("bmc_url", "bmc_system_id", "bmc_credential_ref"):
                node.pop(field, None)

        bmc_url = groups["bmc_off"][0]["bmc_url"]
        password = sim_bmc_password(data_dir)
        log(f"powering {len(groups['bmc_off'])} nodes off through the emulator first")
        with httpx.Client(base_url=bmc_url, auth=(USERNAME, password), timeout=30) as redfish:
            for node in groups["bmc_off"]:
                path = f"/redfish/v1/Systems/{system_id_of(node['id'])}"
                redfish.post(f"{path}/Actions/ComputerSystem.Reset", json={"ResetType": "ForceOff"}).raise_for_status()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                states = [
                    redfish.get(f"/redfish/v1/Systems/{system_id_of(n['id'])}").json()["PowerState"]
                    for n in groups["bmc_off"]
                ]
                if set(states) == {"Off"}:
                    break
                time.sleep(1)
        time.sleep(1.0)  # the fleet hears of the last ones

        figures: dict[str, float] = {}
        for name, members in groups.items():
            ids = [n["id"] for n in members]
            log(f"{name}: {len(ids)} nodes enrolled -> available")
            started = time.monotonic()
            api.post("/v1/nodes:enroll", json={"nodes": members}).raise_for_status()
            while available(engine, ids) < len(ids):
                if time.monotonic() - started > 900:
                    raise SystemExit(f"{name}: only {available(engine, ids)} of {len(ids)} available after 900 s")
                time.sleep(0.5)
            seconds = time.monotonic() - started
            figures[f"{name}_s"] = round(seconds, 1)
            figures[f"{name}_nodes_per_s"] = round(len(ids) / seconds, 2)
            log(f"  {seconds:.1f} s ({len(ids) / seconds:.2f} nodes/s)")
        with engine.connect() as conn:
            cycled = conn.execute(
                sa.text("SELECT count(*) FROM nodetransition WHERE event = 'power_on' AND cause LIKE '%Off -> On%'")
            ).scalar_one()
    finally:
        stop.set()
        stack.stop()
        shutil.rmtree(data_dir, ignore_errors=True)

    print(
        json.dumps(
            {
                "nodes": nodes,
                "group": group,
                **figures,
                "ratio_bmc_on_vs_no_bmc": round(figures["bmc_on_nodes_per_s"] / figures["no_bmc_nodes_per_s"], 3),
                "bmc_off_floor_s": 11 + BOOT_S,
                "powered_on_through_redfish": cycled,
            }
        )
    )


if __name__ == "__main__":
    main()
