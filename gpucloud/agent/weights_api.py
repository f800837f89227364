"""The agent's weights API: what the staged rollout asks of one node, over HTTP.

`install_weights_api` adds these routes to an app the node already serves (the peer app of
`gpucloud.agent.peer`, or the action API of `gpucloud.agent.app`); nothing there changes.

    GET  /weights/status            active and previous version, versions on disk
    POST /weights/prefetch          keep the signed manifest, fetch by the tracker's plan, assemble
                                    (a real node first trusts the tenant keys it carries)
    POST /weights/verify            re-hash every file of an assembled version
    POST /weights/activate          verify, then switch `current` (the old one becomes `previous`)
    POST /weights/rollback          if `digest` is current: switch back to `previous`
    GET  /weights/check             node health and the evaluation probe's score of `current`
    POST /weights/evaluate          the model's evaluations (sanity, its command) on `current`,
                                    against `previous` (what the node ran before)

Every step is idempotent, so a rollout activity that is retried (a lost worker, a timeout)
repeats it safely: a prefetch of an assembled version fetches nothing, activating the active
version changes nothing, and a rollback names the version it undoes, so a second one (or one
on a node that never switched) is a no-op rather than a step back past the version the node ran
before. On a node that ran no version before, rollback leaves it running none.

Prefetches of one version on one node are serialised: a retried request waits for the first
one and then finds the version assembled, instead of fetching beside it under the same name.

`/weights/evaluate` runs the platform's evaluators (`gpucloud.registry.evaluators`) on the files
the node now serves, for the rollout's canary check: the weight-sanity evaluator against the
version the node ran before, and the model's own command (on the tenant's node, in the host's
environment unless it names an image; a simulated node runs none). Each version's outcome is kept, so a retried check
does not run them twice.

Health and the evaluation probe are injected: `health_from_probe` reads the node's GPU probe
(unhealthy on a fatal driver or GPU error); the default evaluation probe re-verifies the active
version (1.0 when intact, else 0.0). A real deployment passes a probe that loads the model and
scores a held-out set.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Annotated, Any

import httpx
from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from gpucloud.adapters.probe import Probe
from gpucloud.agent.chunk_cache import ChunkCache, NoPreviousVersionError
from gpucloud.agent.peer import ChunkFetcher, FetchError, prefetch
from gpucloud.models.registry_names import EvaluatorName
from gpucloud.models.registry_tables import EvaluationCommand
from gpucloud.registry.evaluators import CommandRunner, evaluate_directory, run_model_command
from gpucloud.registry.manifest import HEX_DIGEST, IntegrityError, SignedManifest, VersionNotFoundError
from gpucloud.registry.tracker_client import TrackerClient
from gpucloud.web import problems

EvalProbe = Callable[[ChunkCache, str], float]
"""Scores the active version (its digest given; files under `cache.current_path`); higher is better."""
HealthCheck = Callable[[], tuple[bool, str]]
"""Whether the node is fit to serve, and why not."""
KeysSent = Callable[[list[str]], None]
"""Takes the tenant's signing keys a prefetch carries (hex Ed25519 public keys) as the ones to trust."""
PUBLIC_KEY = r"^[0-9a-f]{64}$"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PrefetchRequest(_Body):
    signed: SignedManifest
    tracker_url: str
    swarm: str = Field(min_length=1)
    token: str | None = Field(
        default=None, description="this node's member token for the swarm: for the tracker and the origin only"
    )
    peer_token: str | None = Field(default=None, description="this node's token for the swarm's peers")
    keys: list[Annotated[str, Field(pattern=PUBLIC_KEY)]] = Field(
        default_factory=list,
        max_length=64,
        description="the tenant's registered, unrevoked signing keys (hex Ed25519 public keys), for a node "
        "that keeps no keyring of its own",
    )
    parallel: int = Field(default=4, ge=1, le=64)


class VersionRequest(_Body):
    digest: str = Field(pattern=HEX_DIGEST)


class EvaluateRequest(VersionRequest):
    evaluators: list[EvaluatorName] = Field(min_length=1, max_length=2)
    command: EvaluationCommand | None = None


def verified_probe(cache: ChunkCache, digest: str) -> float:
    try:
        cache.verify(digest)
    except (IntegrityError, VersionNotFoundError):
        return 0.0
    return 1.0


def always_healthy() -> tuple[bool, str]:
    return True, ""


def health_from_probe(probe: Probe) -> HealthCheck:
    """Health from the node's GPU probe (`gpucloud.adapters.probe.Probe`)."""

    def check() -> tuple[bool, str]:
        reading = probe.read()
        if reading.fatal_error is not None:
            return False, f"probe: {reading.fatal_error.model_dump_json()}"
        return True, ""

    return check


def _integrity_problem(exc: Exception) -> JSONResponse:
    if isinstance(exc, VersionNotFoundError):
        return problems.problem_response(404, "Version not found", str(exc))
    return problems.problem_response(409, "Integrity check failed", f"{type(exc).__name__}: {exc}")


def install_weights_api(
    app: FastAPI,
    *,
    node_id: str,
    cache: ChunkCache,
    eval_probe: EvalProbe = verified_probe,
    health: HealthCheck = always_healthy,
    container_runtime: str | None = None,
    run_command: CommandRunner | None = None,
    trust: KeysSent | None = None,
) -> None:
    """Add the `/weights/*` routes (see the module doc) to `app`. A model's command runs as
    `run_command` says (a simulated node's runs nothing); by default in `container_runtime`
    when it names an image, else on the host: the tenant's own node. `trust`: where the keys a
    prefetch carries go (None: the cache's keyring is the control plane's own, and they are ignored)."""
    if run_command is None:
        run_command = functools.partial(run_model_command, runtime=container_runtime, host_commands=True)
    prefetching: dict[str, threading.Lock] = {}
    guard = threading.Lock()
    evaluated: dict[str, dict] = {}
    evaluating = threading.Lock()

    def state() -> dict:
        return {"node_id": node_id, "active": cache.active(), "previous": cache.previous()}

    @app.get("/weights/status")
    def status() -> dict:
        return state() | {"versions": cache.versions()}

    @app.post("/weights/prefetch")
    def prefetch_version(req: PrefetchRequest):
        digest = req.signed.digest
        if trust is not None:
            trust(req.keys)
        with guard:
            lock = prefetching.setdefault(digest, threading.Lock())
        with lock:
            if digest in cache.versions():
                return state() | {"digest": digest, "peer_bytes": 0, "origin_bytes": 0}
            tracker = TrackerClient(req.tracker_url, token=req.token)
            fetcher = ChunkFetcher(
                node=node_id,
                cache=cache,
                tracker=tracker,
                swarm=req.swarm,
                peer_token=req.peer_token,
                parallel=req.parallel,
            )
            try:
                result = prefetch(req.signed, cache=cache, fetcher=fetcher)
            except IntegrityError as exc:
                return _integrity_problem(exc)
            except FetchError as exc:
                return problems.problem_response(503, "Fetch failed", str(exc))
            except httpx.HTTPError as exc:  # the tracker is down or restarting: the rollout retries
                return problems.problem_response(503, "Tracker unavailable", f"{type(exc).__name__}: {exc}")
            finally:
                fetcher.close()
                tracker.close()
        return state() | {
            "digest": digest,
            "peer_bytes": result.stats.peer_bytes,
            "origin_bytes": result.stats.origin_bytes,
        }

    def checked(step: Callable[[str], object], digest: str, answer: dict[str, Any]):
        """The node's state after `step` on a version, or the problem its files have."""
        try:
            step(digest)
        except (IntegrityError, VersionNotFoundError) as exc:
            return _integrity_problem(exc)
        return state() | answer

    @app.post("/weights/verify")
    def verify(req: VersionRequest):
        return checked(cache.verify, req.digest, {"digest": req.digest, "verified": True})

    @app.post("/weights/activate")
    def activate(req: VersionRequest):
        return checked(cache.activate, req.digest, {})

    @app.post("/weights/rollback")
    def rollback(req: VersionRequest):
        if cache.active() == req.digest:
            try:
                cache.rollback()
            except NoPreviousVersionError:
                cache.deactivate(req.digest)
            except IntegrityError as exc:
                # The previous version rotted on disk: serve nothing rather than the bad version.
                cache.deactivate(req.digest)
                return problems.problem_response(
                    409, "Previous version corrupt", f"{exc}; this node now serves no version"
                )
        return state()

    @app.post("/weights/evaluate")
    def evaluate(req: EvaluateRequest):
        if cache.active() != req.digest:
            return problems.problem_response(
                409, "Version not active", f"{req.digest} is not this node's active version ({cache.active()})"
            )
        key = req.model_dump_json()
        with evaluating:  # one evaluation at a time on a node: they read every byte of the model
            if key not in evaluated:
                previous = cache.previous()
                parent = cache.version_path(previous) if previous and previous != req.digest else None
                outcomes = evaluate_directory(
                    cache.version_path(req.digest),
                    parent if parent is not None and parent.is_dir() else None,
                    req.evaluators,
                    req.command,
                    run_command=run_command,
                )
                evaluated[key] = {
                    "outcomes": {
                        name: {"results": o.results, "failure": o.failure, "details": o.details}
                        for name, o in outcomes.items()
                    },
                    "compared_with": previous if parent is not None else None,
                }
            return state() | {"digest": req.digest, **evaluated[key]}

    @app.get("/weights/check")
    def check(digest: Annotated[str, Query(pattern=HEX_DIGEST)]):
        healthy, why = health()
        active = cache.active()
        score = eval_probe(cache, active) if active == digest else None
        return state() | {"healthy": healthy, "health_detail": why, "eval_score": score}
