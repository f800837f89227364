"""Weight fan-out benchmark: how long until every node holds the artifact, per strategy.

Runs the discrete-event simulator (`gpucloud.registry.fanout_model`) for origin-only, tiered mirrors and
p2p on the ARCHITECTURE.md scenario (141 GB to 1,000 nodes, 100 Gb/s NICs and origin, 64 MiB
chunks), or with --quick on a smaller one that finishes in seconds. Each time is also given as
a multiple of the lower bound (size / NIC + ceil(log2 N) x chunk / NIC).

Then a real-bytes run (`real_fanout`): a safetensors artifact (1 GiB; 64 MiB with --quick) is
pushed to a local chunk store and fanned out over loopback HTTP to simulated agents (32; 16 with
--quick), each with its own chunk cache and its own uvicorn peer server, fetching by the
tracker service's plan with the origin in front of the store. Every node assembles, verifies
(every file re-hashed against the signed manifest) and activates the version, then prunes its
loose chunks. It reports how many nodes verified and origin egress over the artifact size. Its
time says little: every node hashes every byte on the same few cores.

Tables go to stderr; the last stdout line is one JSON object with the figures.

    python benchmarks/fanout.py [--quick] [--seed N] [--real-dir PARENT] [--skip-real]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from gpucloud.agent.chunk_cache import ChunkCache
from gpucloud.agent.peer import ChunkFetcher, FetchStats, PeerServer, create_peer_app
from gpucloud.devstack.stack import free_port
from gpucloud.registry.chunking import ChunkPolicy, MiB, encode_safetensors_header
from gpucloud.registry.fanout_model.config import STRATEGIES, FanoutConfig, FanoutResult
from gpucloud.registry.fanout_model.simulation import simulate
from gpucloud.registry.manifest import Keyring, SignedManifest, Signer
from gpucloud.registry.push import StoreTarget, push
from gpucloud.registry.store import LocalChunkStore, LocalManifestStore
from gpucloud.registry.swarm import PeerPlace, SwarmSpec
from gpucloud.registry.tracker_client import TrackerClient

GIB = 1 << 30
FULL = {"nodes": 1000, "artifact_bytes": 141 * 10**9}
QUICK = {"nodes": 200, "artifact_bytes": 16 * GIB}
REAL_FULL = {"nodes": 32, "artifact_bytes": GIB, "chunk_bytes": 16 * MiB}
REAL_QUICK = {"nodes": 16, "artifact_bytes": 64 * MiB, "chunk_bytes": 2 * MiB}
REAL_NODES_PER_RACK = 4
# The tracker and origin run in a process of their own, as in production, so the agents' threads
# here do not share its interpreter lock.
TRACKER_MAIN = """
import sys, uvicorn
from gpucloud.registry.store import LocalChunkStore
from gpucloud.entrypoints.tracker import create_tracker_app
app = create_tracker_app(chunk_store=LocalChunkStore(sys.argv[1]), seed=0)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning", access_log=False)
"""
# Assemblies at once: each briefly holds a second copy of the artifact on disk, until its prune.
REAL_ASSEMBLIES = 2


def run_all(scenario: dict, *, seed: int, console: Console) -> dict[str, tuple[FanoutResult, float]]:
    results: dict[str, tuple[FanoutResult, float]] = {}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("simulating", total=len(STRATEGIES))
        for strategy in STRATEGIES:
            progress.update(task, description=f"simulating {strategy}")
            started = time.perf_counter()
            result = simulate(FanoutConfig(strategy=strategy, seed=seed, **scenario))
            results[strategy] = (result, time.perf_counter() - started)
            progress.advance(task)
    return results


def table(results: dict[str, tuple[FanoutResult, float]]) -> Table:
    any_result = next(iter(results.values()))[0]
    config = any_result.config
    title = (
        f"{config.artifact_bytes / 1e9:.1f} GB to {config.nodes} nodes, "
        f"{config.nic_up_gbps:g} Gb/s NICs, {config.origin_gbps:g} Gb/s origin, "
        f"bound {any_result.bound_s:.2f} s"
    )
    out = Table(title=title)
    for column in ("strategy", "p50 s", "p99 s", "max s", "p50/bound", "p99/bound", "egress/size", "wall s"):
        out.add_column(column, justify="left" if column == "strategy" else "right", no_wrap=True)
    for strategy, (result, wall) in results.items():
        out.add_row(
            strategy,
            f"{result.p50_s:,.2f}",
            f"{result.p99_s:,.2f}",
            f"{result.max_s:,.2f}",
            f"{result.p50_over_bound:,.2f}x",
            f"{result.p99_over_bound:,.2f}x",
            f"{result.origin_egress_x:,.2f}x",
            f"{wall:.1f}",
        )
    return out


def summary(results: dict[str, tuple[FanoutResult, float]], *, quick: bool) -> dict:
    p2p, origin_only, tiered = (results[name][0] for name in ("p2p", "origin_only", "tiered_mirrors"))
    return {
        "scenario": "quick" if quick else "full",
        "nodes": p2p.config.nodes,
        "artifact_bytes": p2p.config.artifact_bytes,
        "chunk_bytes": p2p.config.chunk_bytes,
        "piece_bytes": p2p.piece_bytes,
        "bound_s": round(p2p.bound_s, 4),
        "p2p_p50_s": round(p2p.p50_s, 3),
        "p2p_p99_s": round(p2p.p99_s, 3),
        "p2p_p50_over_bound": round(p2p.p50_over_bound, 4),
        "p2p_p99_over_bound": round(p2p.p99_over_bound, 4),
        "p2p_max_over_bound": round(p2p.max_over_bound, 4),
        "p2p_origin_egress_x": round(p2p.origin_egress_x, 4),
        "origin_only_p99_s": round(origin_only.p99_s, 1),
        "origin_only_p99_over_bound": round(origin_only.p99_over_bound, 2),
        "tiered_p99_s": round(tiered.p99_s, 2),
        "tiered_p99_over_bound": round(tiered.p99_over_bound, 2),
        "tiered_origin_egress_x": round(tiered.origin_egress_x, 2),
        "sim_wall_s": {name: round(wall, 2) for name, (_, wall) in results.items()},
        "real_nodes_verified": None,
        "real_origin_egress_x": None,
    }


class _Agent:
    """One simulated node: its chunk cache behind its own peer server."""

    def __init__(self, index: int, root: Path, keyring: Keyring) -> None:
        self.node = f"node-{index:03d}"
        self.rack = f"rack-{index // REAL_NODES_PER_RACK}"
        self.cache = ChunkCache(root / self.node, keyring=keyring, tenant="bench")
        self.server = PeerServer(create_peer_app(self.cache))


def write_artifact(directory: Path, size: int, chunk_bytes: int) -> None:
    """A safetensors file whose tensors are 1.5 chunks long (so chunks cut inside tensors)."""
    directory.mkdir(parents=True)
    tensor = chunk_bytes * 3 // 2 // 8 * 8
    sizes = [tensor] * (size // tensor) + ([size % tensor] if size % tensor else [])
    tensors = [(f"layers.{i}.weight", n) for i, n in enumerate(sizes)]
    with open(directory / "model.safetensors", "wb") as out:
        out.write(encode_safetensors_header(tensors))
        for _, n in tensors:
            out.write(os.urandom(n))
    (directory / "config.json").write_text(json.dumps({"tensors": len(tensors)}))


def _push_artifact(workdir: Path, scenario: dict, signer: Signer) -> tuple[SignedManifest, LocalChunkStore]:
    chunk = scenario["chunk_bytes"]
    write_artifact(workdir / "source", scenario["artifact_bytes"], chunk)
    store = LocalChunkStore(workdir / "store")
    policy = ChunkPolicy(max_chunk_size=chunk, pack_size=MiB, fixed_chunk_size=chunk)
    result = push(
        workdir / "source",
        model="bench",
        target=StoreTarget(store, LocalManifestStore(workdir / "manifests"), settle_seconds=0),
        signer=signer,
        policy=policy,
    )
    shutil.rmtree(workdir / "source")  # the store holds it now
    return result.signed, store


def _start_tracker(store: LocalChunkStore) -> tuple[subprocess.Popen, TrackerClient]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", TRACKER_MAIN, str(store.root), str(port)])
    tracker = TrackerClient(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 60
    while True:
        try:
            tracker.origin_stats()
            return process, tracker
        except httpx.TransportError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("the tracker process did not come up") from None
            time.sleep(0.1)


def _check_disk(parent: str | None, scenario: dict) -> None:
    # Every node holds a copy, assembling nodes briefly two, plus the store.
    need = scenario["artifact_bytes"] * (scenario["nodes"] + REAL_ASSEMBLIES + 2)
    free = shutil.disk_usage(parent or tempfile.gettempdir()).free
    if free < need * 1.1:
        raise SystemExit(f"real run needs about {need / GIB:.1f} GiB free, {free / GIB:.1f} GiB left")


class _Outcome(NamedTuple):
    verified: bool  # activated, which re-hashed every file against the signed manifest
    stats: FetchStats | None
    seconds: float
    error: str | None


def _fan_out(agents: list[_Agent], signed: SignedManifest, tracker: TrackerClient, console: Console) -> list[_Outcome]:
    """Run every node at once."""
    assembly_slots = threading.Semaphore(REAL_ASSEMBLIES)
    started = time.perf_counter()

    def one(agent: _Agent) -> _Outcome:
        fetcher = ChunkFetcher(node=agent.node, cache=agent.cache, tracker=tracker, swarm="bench")
        try:
            fetcher.fetch(agent.cache.add_manifest(signed))
            with assembly_slots:
                agent.cache.assemble(signed.digest)
                agent.cache.activate(signed.digest)
                agent.cache.prune()  # serve from the version's files; drop the loose copies
        except Exception as exc:  # one failed node is a figure of the run, not the end of it
            console.print(f"[red]{agent.node} failed: {exc!r}")
            return _Outcome(False, fetcher.stats, time.perf_counter() - started, f"{agent.node}: {exc!r}")
        finally:
            fetcher.close()
        verified = agent.cache.active() == signed.digest
        return _Outcome(verified, fetcher.stats, time.perf_counter() - started, None)

    chunks = signed.manifest.chunk_count
    with ThreadPoolExecutor(len(agents)) as pool, Progress(console=console, transient=True) as progress:
        fetched = progress.add_task("chunks fetched", total=len(agents) * chunks)
        done = progress.add_task("nodes activated", total=len(agents))
        futures = [pool.submit(one, agent) for agent in agents]
        while not all(f.done() for f in futures):
            progress.update(fetched, completed=sum(tracker.status("bench").held.values()))
            progress.update(done, completed=sum(f.done() for f in futures))
            time.sleep(0.5)
        return [f.result() for f in futures]


def real_fanout(scenario: dict, *, parent: str | None, console: Console) -> dict:
    """Real bytes over loopback HTTP; see the module doc. Everything on disk is removed after."""
    _check_disk(parent, scenario)
    workdir = Path(tempfile.mkdtemp(prefix="gpucloud-fanout-", dir=parent))
    servers: list[PeerServer] = []
    tracker_process: subprocess.Popen | None = None
    try:
        signer, keyring = Signer.generate(), Keyring()
        keyring.trust("bench", signer.verify_key)
        console.print(f"real run: pushing {scenario['artifact_bytes'] / GIB:.2f} GiB")
        signed, store = _push_artifact(workdir, scenario, signer)
        tracker_process, tracker = _start_tracker(store)
        agents = [_Agent(i, workdir / "nodes", keyring) for i in range(scenario["nodes"])]
        for agent in agents:
            servers.append(agent.server)
            agent.server.start()
        places = {a.node: PeerPlace(rack=a.rack, site="site-1", url=a.server.url) for a in agents}
        spec = SwarmSpec(nodes=places, chunks=sorted(signed.manifest.chunk_ids()))
        tracker.register_swarm("bench", spec)
        started = time.perf_counter()
        outcomes = _fan_out(agents, signed, tracker, console)
        wall = time.perf_counter() - started
        size = signed.manifest.total_size
        egress = tracker.origin_stats().egress_bytes
        stats = [o.stats for o in outcomes if o.stats is not None]
        times = sorted(o.seconds for o in outcomes)
        return {
            "real_nodes": len(agents),
            "real_artifact_bytes": size,
            "real_chunk_bytes": scenario["chunk_bytes"],
            "real_nodes_verified": sum(o.verified for o in outcomes),
            "real_origin_egress_x": round(egress / size, 4),
            "real_peer_bytes_x": round(sum(s.peer_bytes for s in stats) / size, 3),
            "real_bad_chunks": sum(s.bad_chunks for s in stats),
            "real_failed_attempts": sum(s.failed_attempts for s in stats),
            "real_wall_s": round(wall, 2),
            "real_node_p50_s": round(times[len(times) // 2], 2),
            "real_node_max_s": round(times[-1], 2),
            "real_node_errors": [o.error for o in outcomes if o.error][:3],
        }
    finally:
        with ThreadPoolExecutor(max(1, len(servers))) as pool:
            list(pool.map(PeerServer.stop, servers))
        if tracker_process is not None:
            tracker_process.terminate()
            tracker_process.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def real_table(real: dict) -> Table:
    out = Table(
        title=f"real bytes: {real['real_artifact_bytes'] / GIB:.2f} GiB to {real['real_nodes']} agents on loopback"
    )
    for column in ("verified", "origin egress/size", "peer bytes/size", "bad chunks", "p50 s", "max s"):
        out.add_column(column, justify="right", no_wrap=True)
    out.add_row(
        f"{real['real_nodes_verified']}/{real['real_nodes']}",
        f"{real['real_origin_egress_x']:.3f}x",
        f"{real['real_peer_bytes_x']:.2f}x",
        str(real["real_bad_chunks"]),
        f"{real['real_node_p50_s']:.1f}",
        f"{real['real_node_max_s']:.1f}",
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller scenario, finishes in seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--real-dir", help="parent directory for the real run's files (default: temp)")
    parser.add_argument("--skip-real", action="store_true", help="simulator only")
    args = parser.parse_args(argv)
    # SIGTERM would otherwise skip the finally that removes the real run's gigabytes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # A pipe gets rich's 80 columns, too narrow for the table; a terminal keeps its own width.
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 110)
    results = run_all(QUICK if args.quick else FULL, seed=args.seed, console=console)
    console.print(table(results))
    figures = summary(results, quick=args.quick)
    if not args.skip_real:
        real = real_fanout(REAL_QUICK if args.quick else REAL_FULL, parent=args.real_dir, console=console)
        console.print(real_table(real))
        figures.update(real)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
