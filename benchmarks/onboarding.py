"""Tenant onboarding at scale: N tenants (default 200) onboarded through `POST /v1/tenants`, each
then allocating and releasing a small slice (1 H100 node in us-east-1), and afterwards every
isolation promise checked against what the fabric managers and the object store hold. Real
stack: Temporal dev server, simulated fabric managers (UFM, NMX-M, SDN over HTTP), worker, API
and simulated fleet as separate processes, SQLite, tenant storage in the data dir.

- Onboarding: `concurrency` tenants in flight; a tenant's latency runs from its POST to its
  operation reading `succeeded` (polled over the API), and the tenant must then read `active`.
- Allocate and release: in waves of at most the fleet's size, every tenant of the wave allocates
  one node; once all are ready the fabric is checked at that peak (each allocation's pkey must
  hold its node, and `fabric/isolation.find_violations` must find nothing), then all cancel and
  the wave ends when the whole fleet is `available` again (wiped and burnt in).
- After the run: the fabric managers again (no membership left: every node is free), every
  tenant's VPC (one per tenant, its VNI its own and the one the DB records), the object store
  (every tenant's prefix distinct, every object under a known tenant's prefix, each tenant's
  record opening only with its own data key and naming it), the API (a tenant's key gets 404 for
  another tenant's tenant, operation and allocation) and the node history (every node that
  changed tenant was wiped in between).

`isolation_violations` sums every finding; it must be 0. `fabric_unapplied` counts ready
allocations whose membership was not found at the peak (the fabric check would be vacuous).

    python benchmarks/onboarding.py [--tenants N] [--nodes N] [--concurrency N] [--quick]

Prints progress to stderr and one JSON line of figures last on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import statistics
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import sqlalchemy as sa
from sqlmodel import select

sys.path.insert(0, str(Path(__file__).parent))
from common import add_temporal_db_arg, bench_stack, log, wait_for

from gpucloud.activities.storage import TENANT_RECORD
from gpucloud.bootstrap import fabric_tokens, tenant_store
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.devstack.stack import Stack
from gpucloud.fabric.http_clients import HttpFabricController
from gpucloud.fabric.interface import DEFAULT_PKEY, FabricNode, FabricSnapshot
from gpucloud.fabric.isolation import find_violations
from gpucloud.fabric.membership import read_snapshot, resource_name
from gpucloud.models.tables import Allocation, Node, NodeTransition, Tenant
from gpucloud.storage.tenant import tenant_prefix

OPERATOR = {"Authorization": "Bearer bench-token"}
SLICE = {"gpu_type": "H100", "node_count": 1, "region": "us-east-1"}
POLL_S = 0.2
# How long a request refused by the API's admission is sent again (after each Retry-After).
ADMISSION_RETRY_S = 120.0


class AdmittedTransport(httpx.AsyncHTTPTransport):
    """Sends a request again after the Retry-After of a 429 or 503, as the project's client does
    (`gpucloud.client.base`): the API admits only a few requests in flight per caller (the
    operator's lane holds `api.operator_slots`) and refuses the rest before reading them, so
    `--concurrency` onboardings queue at the API's door instead of failing there. The wait is
    part of the latency measured, as it is for a real caller."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        deadline = time.monotonic() + ADMISSION_RETRY_S
        while True:
            response = await super().handle_async_request(request)
            if response.status_code not in (429, 503) or time.monotonic() > deadline:
                return response
            await response.aclose()
            try:
                wait_s = float(response.headers.get("retry-after", ""))
            except ValueError:
                wait_s = 0.25
            await asyncio.sleep(min(max(wait_s, 0.05), 5.0))


def api_client(settings: Settings, **options) -> httpx.AsyncClient:
    """An async client of the stack's API whose refused requests wait their turn (above)."""
    return httpx.AsyncClient(base_url=settings.api_url, transport=AdmittedTransport(), **options)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0-100)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


# ---------------------------------------------------------------- onboarding


async def onboard_all(settings: Settings, names: list[str], concurrency: int) -> tuple[list[dict], list[str], float]:
    """Onboard every name, `concurrency` at a time. Returns the tenants (id, key, op, latency),
    the failures, and the wall time."""
    gate = asyncio.Semaphore(concurrency)
    done: list[dict] = []
    failures: list[str] = []
    async with api_client(settings, headers=OPERATOR, timeout=120) as api:

        async def one(name: str) -> None:
            async with gate:
                started = time.monotonic()
                quotas = [{"gpu_type": "H100", "region": "us-east-1", "max_gpus": 8}]  # its one node
                resp = await api.post("/v1/tenants", json={"name": name, "quotas": quotas})
                if resp.status_code != 202:
                    failures.append(f"{name}: POST {resp.status_code} {resp.text[:200]}")
                    return
                body = resp.json()
                op_id = body["operation"]["id"]
                while True:
                    op = (await api.get(f"/v1/operations/{op_id}")).json()
                    if op.get("status") != "running":
                        break
                    if time.monotonic() - started > 600:
                        failures.append(f"{name}: onboarding still running after 600 s")
                        return
                    await asyncio.sleep(POLL_S)
                latency = time.monotonic() - started
                tenant = (await api.get(f"/v1/tenants/{body['id']}")).json()
                if op.get("status") != "succeeded" or tenant.get("status") != "active":
                    failures.append(
                        f"{name}: operation {op.get('status')} ({op.get('error')}), tenant {tenant.get('status')}"
                    )
                    return
                done.append(
                    {"id": body["id"], "name": name, "key": body["api_key"]["key"], "op": op_id, "latency_s": latency}
                )
                if len(done) % 20 == 0:
                    log(f"  {len(done)}/{len(names)} active")

        started = time.monotonic()
        await asyncio.gather(*(one(n) for n in names))
        return done, failures, time.monotonic() - started


# ---------------------------------------------------------------- allocate and release


def allocation_statuses(engine: sa.Engine, ids: list[str]) -> dict[str, str]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id, status FROM allocation WHERE id IN :ids").bindparams(
                sa.bindparam("ids", expanding=True)
            ),
            {"ids": ids},
        ).all()
    return dict(rows)


async def allocate_wave(settings: Settings, wave: list[dict]) -> list[str]:
    """Each tenant of the wave allocates the slice (retrying contention); sets t["alloc"]."""
    gate = asyncio.Semaphore(16)
    failures: list[str] = []
    async with api_client(settings, timeout=120) as api:

        async def one(t: dict) -> None:
            async with gate:
                for attempt in range(20):
                    resp = await api.post(
                        "/v1/allocations", json=SLICE, headers={"Authorization": f"Bearer {t['key']}"}
                    )
                    if resp.status_code == 202:
                        t["alloc"] = resp.json()["allocation"]["id"]
                        return
                    if resp.status_code not in (409, 503) or "quota" in resp.text:
                        break
                    await asyncio.sleep(0.25 * (attempt + 1))
                failures.append(f"{t['name']}: allocate {resp.status_code} {resp.text[:200]}")

        await asyncio.gather(*(one(t) for t in wave))
    return failures


async def cancel_wave(settings: Settings, wave: list[dict]) -> list[str]:
    gate = asyncio.Semaphore(16)
    failures: list[str] = []
    async with api_client(settings, timeout=120) as api:

        async def one(t: dict) -> None:
            async with gate:
                resp = await api.post(
                    f"/v1/allocations/{t['alloc']}/cancel", headers={"Authorization": f"Bearer {t['key']}"}
                )
                if resp.status_code not in (200, 202):
                    failures.append(f"{t['name']}: cancel {resp.status_code} {resp.text[:200]}")

        await asyncio.gather(*(one(t) for t in wave if "alloc" in t))
    return failures


def wait_allocations(engine: sa.Engine, ids: list[str], want: set[str], what: str, timeout_s: float) -> dict[str, str]:
    """Until every allocation's status is in `want` or terminal; returns the statuses."""
    started = time.monotonic()
    last = None
    while True:
        statuses = allocation_statuses(engine, ids)
        counts = dict(sorted(Counter(statuses.values()).items()))
        if counts != last:
            log(f"  {what}: {counts}")
            last = counts
        if all(s in want or s in ("failed", "released") for s in statuses.values()) and len(statuses) == len(ids):
            return statuses
        if time.monotonic() - started > timeout_s:
            raise SystemExit(f"timed out: {what} ({counts})")
        time.sleep(0.3)


# ---------------------------------------------------------------- checks


def read_nodes(settings: Settings) -> tuple[dict[str, FabricNode], dict[str, str]]:
    """The fabric topology, and who holds each node: the tenant whose data is on it, else the
    tenant of the allocation it is reserved for."""
    with session_scope(settings.database_url) as session:
        owner = dict(session.exec(select(Allocation.id, Allocation.tenant_id)).all())
        nodes = session.exec(select(Node)).all()
        topology = {
            n.id: FabricNode(
                node_id=n.id,
                port_guids=tuple(n.ib_port_guids or ()),
                nvl_domain=n.nvlink_domain,
                gpu_uids=tuple(n.gpu_uids or ()),
            )
            for n in nodes
        }
        held = {n.id: n.tenant_id or owner.get(n.allocation_id) for n in nodes if n.tenant_id or n.allocation_id}
    return topology, {k: v for k, v in held.items() if v}


def fabric_managers(stack: Stack) -> HttpFabricController:
    """A client of the stack's simulated fabric managers holding each manager's own token, the
    ones the stack hands the managers and the worker (kept in its data dir): the managers answer
    nothing else."""
    return HttpFabricController.for_simulator(stack.fabric_url, tokens=fabric_tokens(stack.settings), timeout_s=60)


def fabric_check(
    settings: Settings, stack: Stack, allocations: dict[str, tuple[str, str]] | None = None
) -> tuple[list[str], int, FabricSnapshot]:
    """Isolation violations in the managers' state now (a finding must show against the node
    holders read both before and after the snapshot), and with `allocations` (id -> (tenant,
    node)) how many of them lack their membership."""
    with fabric_managers(stack) as controller:
        topology, before = read_nodes(settings)
        snapshot = read_snapshot(controller)
        _, after = read_nodes(settings)
    found = [set(find_violations(snapshot, topology=topology, tenant_of=held)) for held in (before, after)]
    violations = [f"{v.kind}: {v.resource}: {v.detail}" for v in sorted(found[0] & found[1], key=str)]
    unapplied = 0
    if allocations:
        pkeys = {p.name: p for p in snapshot.pkeys}
        vpc_nodes = {n: v.tenant_id for v in snapshot.vpcs for n in v.nodes}
        for alloc_id, (tenant_id, node_id) in allocations.items():
            pkey = pkeys.get(resource_name(alloc_id))
            guids = set(topology[node_id].port_guids)
            if pkey is None or not guids or pkey.guids() != guids or vpc_nodes.get(node_id) != tenant_id:
                unapplied += 1
    return violations, unapplied, snapshot


def vpc_check(settings: Settings, stack: Stack, tenant_ids: set[str]) -> list[str]:
    """One VPC per tenant, its own VNI, the one the DB records; no VPC of an unknown tenant."""
    found: list[str] = []
    with fabric_managers(stack) as controller:
        vpcs = controller.ethernet.list_vpcs()
    with session_scope(settings.database_url) as session:
        vni_of = dict(session.exec(select(Tenant.id, Tenant.vni).where(Tenant.id.in_(tenant_ids))).all())
    by_tenant: dict[str, list[int]] = {}
    for vni, n in Counter(v.vni for v in vpcs).items():
        if n > 1:
            found.append(f"vni_shared: VNI {vni} in {n} VPCs")
    for vpc in vpcs:
        by_tenant.setdefault(vpc.tenant_id, []).append(vpc.vni)
        if vpc.tenant_id not in tenant_ids:
            found.append(f"vpc_of_unknown_tenant: VNI {vpc.vni} of {vpc.tenant_id}")
    for tenant_id in sorted(tenant_ids):
        vnis = by_tenant.get(tenant_id, [])
        if len(vnis) != 1:
            found.append(f"vpc_count: tenant {tenant_id} has {len(vnis)} VPCs")
        elif vni_of.get(tenant_id) != vnis[0]:
            found.append(
                f"vni_mismatch: tenant {tenant_id} has VNI {vnis[0]} on the SDN, {vni_of.get(tenant_id)} in the DB"
            )
    if len({v for v in vni_of.values() if v is not None}) != sum(1 for v in vni_of.values() if v is not None):
        found.append("vni_shared_in_db")
    return found


def storage_check(settings: Settings, tenants: list[dict]) -> tuple[list[str], int]:
    """Every tenant's prefix its own and distinct, every object under a known tenant's prefix (or
    the control area), each tenant's record opening with its key alone and naming the tenant.
    Returns the findings and the number of objects seen."""
    from gpucloud.storage.envelope import KEY_RECORDS

    found: list[str] = []
    if not (settings.tenants.storage_master_key or (settings.data_dir / "storage_master_key").exists()):
        return ["storage: no master key in the data dir (the worker never provisioned storage)"], 0
    store = tenant_store(settings)
    ids = [t["id"] for t in tenants]
    with session_scope(settings.database_url) as session:
        prefix_of = dict(session.exec(select(Tenant.id, Tenant.storage_prefix)).all())
    known = set(prefix_of)
    for prefix, n in Counter(p for p in prefix_of.values() if p).items():
        if n > 1:
            found.append(f"prefix_shared: {prefix} recorded for {n} tenants")
    for tenant_id in ids:
        if prefix_of.get(tenant_id) != tenant_prefix(tenant_id):
            found.append(f"prefix_wrong: tenant {tenant_id} has {prefix_of.get(tenant_id)!r}")
    keys = store.backend.list_keys("")
    for key in keys:
        if key.startswith(KEY_RECORDS):
            owner = key[len(KEY_RECORDS) :].removesuffix(".json")
            if owner not in known:
                found.append(f"key_record_of_unknown_tenant: {key}")
            continue
        parts = key.split("/")
        if len(parts) < 3 or parts[0] != "tenants" or parts[1] not in known:
            found.append(f"object_outside_tenant_prefixes: {key}")
    for i, tenant_id in enumerate(ids):
        storage = store.tenant(tenant_id)
        try:
            record = json.loads(storage.get_encrypted(TENANT_RECORD))
        except Exception as exc:
            found.append(f"record_unreadable: tenant {tenant_id}: {type(exc).__name__}: {exc}")
            continue
        if record.get("tenant_id") != tenant_id:
            found.append(f"foreign_record: {storage.object_key(TENANT_RECORD)} names {record.get('tenant_id')}")
        # The neighbour's data key must not open this tenant's record.
        other = ids[(i + 1) % len(ids)]
        if other != tenant_id:
            full_key = storage.object_key(TENANT_RECORD)
            try:
                store.keys.decrypt(other, store.backend.get(full_key), context=full_key)
                found.append(f"cross_key_opens: tenant {other}'s key opens {full_key}")
            except Exception:
                pass
    return found, len(keys)


async def api_check(settings: Settings, tenants: list[dict]) -> list[str]:
    """A tenant's key reads its neighbour's tenant, onboarding operation and allocation as 404."""
    found: list[str] = []
    gate = asyncio.Semaphore(16)
    async with api_client(settings, timeout=60) as api:

        async def one(i: int) -> None:
            me, other = tenants[i], tenants[(i + 1) % len(tenants)]
            if me is other:
                return
            paths = [f"/v1/tenants/{other['id']}", f"/v1/operations/{other['op']}"]
            if "alloc" in other:
                paths += [f"/v1/allocations/{other['alloc']}"]
            async with gate:
                headers = {"Authorization": f"Bearer {me['key']}"}
                for path in paths:
                    resp = await api.get(path, headers=headers)
                    if resp.status_code != 404:
                        found.append(f"api_foreign_read: {me['id']} GET {path} -> {resp.status_code}")
                if "alloc" in other:
                    resp = await api.post(f"/v1/allocations/{other['alloc']}/cancel", headers=headers)
                    if resp.status_code != 404:
                        found.append(f"api_foreign_cancel: {me['id']} -> {resp.status_code}")

        await asyncio.gather(*(one(i) for i in range(len(tenants))))
    return found


def wipe_check(settings: Settings) -> tuple[list[str], int]:
    """Every node that changed tenant was wiped in between (from the node's transition history).
    Returns the findings and how many changes of tenant the history shows."""
    with session_scope(settings.database_url) as session:
        tenant_of_alloc = dict(session.exec(select(Allocation.id, Allocation.tenant_id)).all())
        history = session.exec(select(NodeTransition).order_by(NodeTransition.seq)).all()
    found: list[str] = []
    reserved_for: dict[str, str | None] = {}
    holds: dict[str, str | None] = {}
    last: dict[str, str | None] = {}
    handovers = 0
    for t in history:
        if t.event == "reserve" and t.op_id:
            reserved_for[t.node_id] = tenant_of_alloc.get(t.op_id.split("-", 1)[1])
        elif t.to_state == "provisioning":
            tenant = reserved_for.get(t.node_id)
            previous = holds.get(t.node_id)
            if tenant is None:
                found.append(f"unknown_tenant: node {t.node_id} provisioned for no known allocation (seq {t.seq})")
            if previous not in (None, tenant):
                found.append(f"unwiped_handover: node {t.node_id} provisioned for {tenant} holding {previous}'s data")
            handovers += last.get(t.node_id) not in (None, tenant)
            holds[t.node_id] = last[t.node_id] = tenant
        elif t.from_state in ("wiping", "repairing") and t.event == "ok":
            holds[t.node_id] = None
    return found, handovers


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=64, help="fleet size; allocations run in waves of this many")
    parser.add_argument("--concurrency", type=int, default=24, help="onboardings in flight")
    parser.add_argument("--quick", action="store_true", help="20 tenants on 16 nodes, under a minute")
    add_temporal_db_arg(parser)
    args = parser.parse_args()
    tenants_n, nodes = (20, 16) if args.quick else (args.tenants, args.nodes)
    concurrency = min(args.concurrency, 16) if args.quick else args.concurrency

    settings, stack, data_dir = bench_stack(nodes, args.temporal_db)
    if not stack.fabric:
        raise SystemExit("the stack must run the simulated fabric managers")
    fabric_url = stack.fabric_url
    run = uuid.uuid4().hex[:6]
    violations: dict[str, list[str]] = {}
    unapplied = 0
    peak_pkeys = 0
    wave_times: list[float] = []
    try:
        log(f"starting stack in {data_dir} (fabric managers on {fabric_url})")
        stack.start(on_step=lambda s: log(f"  {s}"))
        engine = sa.create_engine(settings.database_url)
        api = httpx.Client(base_url=settings.api_url, headers=OPERATOR, timeout=300)
        from gpucloud.sim.client import SimFleetClient

        with SimFleetClient(settings.sim_url, token=settings.operator_token, timeout_s=60) as sim:
            inventory = sim.inventory()
        log(f"bring-up: {nodes} nodes")
        api.post("/v1/nodes:enroll", json={"nodes": inventory}).raise_for_status()
        wait_for(engine, "available", nodes, "bring-up", 900)

        log(f"onboarding: {tenants_n} tenants, {concurrency} in flight")
        names = [f"bench-{run}-{i:04d}" for i in range(tenants_n)]
        tenants, failed, onboard_wall_s = asyncio.run(onboard_all(settings, names, concurrency))
        for f in failed:
            log(f"  FAILED {f}")
        latencies = [t["latency_s"] for t in tenants]
        log(
            f"  {len(tenants)} active in {onboard_wall_s:.1f} s; p50 {percentile(latencies, 50):.2f} s, "
            f"p99 {percentile(latencies, 99):.2f} s"
        )
        tenants.sort(key=lambda t: t["name"])

        log(f"allocate and release: 1 node each, waves of {nodes}")
        alloc_failed: list[str] = []
        started = time.monotonic()
        for w in range(0, len(tenants), nodes):
            wave = tenants[w : w + nodes]
            wave_started = time.monotonic()
            alloc_failed += asyncio.run(allocate_wave(settings, wave))
            ids = [t["alloc"] for t in wave if "alloc" in t]
            statuses = wait_allocations(engine, ids, {"ready"}, f"wave {w // nodes + 1} ready", 900)
            ready = {t["alloc"] for t in wave if statuses.get(t.get("alloc")) == "ready"}
            alloc_failed += [
                f"{t['name']}: allocation {statuses.get(t['alloc'])}"
                for t in wave
                if "alloc" in t and t["alloc"] not in ready
            ]
            with session_scope(settings.database_url) as session:
                rows = session.exec(
                    select(Allocation.id, Allocation.tenant_id, Allocation.node_ids).where(Allocation.id.in_(ready))
                ).all()
            held = {a: (tenant, node_ids[0]) for a, tenant, node_ids in rows if node_ids}
            found, missing, snapshot = fabric_check(settings, stack, held)
            peak_pkeys = max(peak_pkeys, sum(1 for p in snapshot.pkeys if p.pkey != DEFAULT_PKEY))
            violations.setdefault("fabric_at_peak", []).extend(found)
            unapplied += missing
            log(
                f"  peak: {len(held)} allocations held, {len(snapshot.pkeys) - 1} pkeys, "
                f"{sum(len(v.nodes) for v in snapshot.vpcs)} VPC attachments; "
                f"{len(found)} violations, {missing} without membership"
            )
            alloc_failed += asyncio.run(cancel_wave(settings, wave))
            wait_allocations(engine, ids, {"released"}, "released", 900)
            wait_for(engine, "available", nodes, "fleet available again", 900)
            wave_times.append(time.monotonic() - wave_started)
        allocate_release_s = time.monotonic() - started
        for f in alloc_failed:
            log(f"  FAILED {f}")
        log(f"  {allocate_release_s:.1f} s for {len(tenants)} allocations in {len(wave_times)} waves")

        log("checks: fabric managers, VPCs, storage, API, node history")
        tenant_ids = {t["id"] for t in tenants}
        found, _, snapshot = fabric_check(settings, stack)
        violations["fabric_at_end"] = found
        leftover = [f"leftover_pkey: 0x{p.pkey:04x} ({p.name})" for p in snapshot.pkeys if p.pkey != DEFAULT_PKEY]
        leftover += [f"leftover_nvl_partition: {p.partition_id}" for p in snapshot.nvl_partitions]
        leftover += [f"leftover_vpc_node: VNI {v.vni}: {n}" for v in snapshot.vpcs for n in v.nodes]
        violations["fabric_leftover"] = leftover
        violations["vpc"] = vpc_check(settings, stack, tenant_ids)
        violations["storage"], objects = storage_check(settings, tenants)
        violations["api"] = asyncio.run(api_check(settings, tenants))
        violations["wipe"], handovers = wipe_check(settings)
        for kind, items in violations.items():
            log(f"  {kind}: {len(items)}")
            for item in items[:10]:
                log(f"    {item}")
    finally:
        stack.stop()
        shutil.rmtree(data_dir, ignore_errors=True)

    failed_names = {f.split(":", 1)[0] for f in failed + alloc_failed}
    print(
        json.dumps(
            {
                "temporal_db": args.temporal_db,
                "tenants": tenants_n,
                "nodes": nodes,
                "concurrency": concurrency,
                "tenants_onboarded": len(tenants),
                "tenants_failed": len(failed_names),
                "onboard_p50_s": round(percentile(latencies, 50), 3),
                "onboard_p99_s": round(percentile(latencies, 99), 3),
                "onboard_mean_s": round(statistics.fmean(latencies), 3) if latencies else None,
                "onboard_max_s": round(max(latencies), 3) if latencies else None,
                "onboard_wall_s": round(onboard_wall_s, 2),
                "onboard_per_s": round(len(tenants) / onboard_wall_s, 2),
                "allocate_release_s": round(allocate_release_s, 2),
                "waves": len(wave_times),
                "wave_s_mean": round(statistics.fmean(wave_times), 2) if wave_times else None,
                "peak_pkeys": peak_pkeys,
                "fabric_unapplied": unapplied,
                "storage_objects": objects,
                "node_handovers_checked": handovers,
                "violations_by_check": {k: len(v) for k, v in violations.items()},
                "isolation_violations": sum(len(v) for v in violations.values()),
            }
        )
    )


if __name__ == "__main__":
    main()
