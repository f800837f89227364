"""Activities of the staged rollout: the node agents' weights API (`gpucloud.agent.weights_api`),
the tracker, the manifest store, and the control-plane DB (to resolve a target, and to re-check it).

Each wave step calls one endpoint on every node of the wave at once and reports an outcome per
node (`WaveResult`); the workflow decides what a failure means. Steps whose failure is worth
another try raise instead, so Temporal retries them (every agent endpoint is idempotent):
a prefetch that did not complete everywhere, and a rollback, which is retried until every node
has switched back. An agent that cannot be reached during verify, activate or check is a failed
node for that wave, which rolls the rollout back. Long steps heartbeat while they wait.

A rollout's targets are resolved once, but nodes leave a tenant while it runs (a release, a
drain), and another tenant's node may answer at the same address later. So every step reads the
wave's nodes from the control-plane DB just before it sends anything (and the canary's
evaluation, which sends the model's command, reads its node again): a node no longer in the
rollout tenant's allocation, or whose agent moved, is reported `dropped` and sent nothing — no
signed manifest, no swarm token, no command. The swarm tokens a prefetch hands out name the
allocation the DB shows at that moment, and the tracker and origin honour them only while the
node is still in it (`gpucloud.entrypoints.tracker`). A worker without a control-plane DB (the
fan-out test harness) sends to the nodes it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import httpx
from sqlmodel import col, select
from temporalio import activity
from temporalio.exceptions import ApplicationError

from gpucloud.activities import ActivityGroup
from gpucloud.adapters.host_agent import HostAgents, HttpHostAgents
from gpucloud.db import Database
from gpucloud.models.rollout_messages import (
    NodeOutcome,
    Prepared,
    PrepareInput,
    ResolvedTargets,
    ResolveTargetsInput,
    RolloutEvaluation,
    RolloutTarget,
    WaveInput,
    WaveResult,
)
from gpucloud.registry.manifest import SignedManifest, VersionNotFoundError
from gpucloud.registry.promotion import active_public_keys, evaluate_gates
from gpucloud.registry.store import ManifestStore
from gpucloud.registry.swarm import PeerPlace, SwarmSpec
from gpucloud.registry.tracker_client import TrackerClient
from gpucloud.services.nodes import Holding, holdings
from gpucloud.web import metrics
from gpucloud.web.service_tokens import (
    SWARM_MEMBER,
    SWARM_PEER,
    SWARM_TOKEN_TTL_S,
    TRACKER_AUDIENCE,
    Issuer,
    swarm_audience,
)

HEARTBEAT_S = 5.0
ManifestSource = Callable[[str], ManifestStore]
"""The manifest store of a tenant (`RegistryStores.manifests` in production)."""


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}"
    return f"HTTP {response.status_code}: {body.get('detail') or body.get('title') or body}"


class _Dropped(Exception):
    """The node left the rollout tenant's allocation: why (it is sent nothing more)."""


def _why_dropped(node: RolloutTarget, holding: Holding | None, tenant_id: str) -> str | None:
    """Why `node` is no longer the rollout's to send to, as the DB has it now (None: it is)."""
    if holding is None:
        return "the node is no longer enrolled"
    if holding.tenant_id != tenant_id:
        return "the node is no longer the tenant's"
    if holding.allocation_id is None:
        return "the node left the tenant's allocation"
    if node.allocation_id is not None and holding.allocation_id != node.allocation_id:
        return f"the node left allocation {node.allocation_id}"
    if holding.agent_url != node.agent_url:
        return "the node's agent answers at another address now"
    return None


class RolloutActivities(ActivityGroup):
    def __init__(
        self,
        *,
        tracker_url: str,
        manifests: ManifestSource,
        db: Database | None = None,
        agents: HostAgents | None = None,
        request_timeout_s: float = 3600.0,
        issuer: Issuer | None = None,
    ) -> None:
        self.tracker_url, self._manifests, self._db = tracker_url, manifests, db
        self._issuer = issuer  # signs the swarm's and the tracker's tokens
        # The control plane's one client of agents (the worker's), which signs each call for its
        # node; a rollout's calls take `request_timeout_s` each (a prefetch moves a whole version).
        self._owns_agents = agents is None
        self._agents: HostAgents = agents or HttpHostAgents(issuer=issuer)
        self._request_timeout_s = request_timeout_s
        self._signed: dict[tuple[str, str], SignedManifest] = {}

    def _swarm_tokens(self, req: WaveInput, node: RolloutTarget) -> dict[str, str | None]:
        """The node's tokens for the rollout's swarm, both naming the node, its tenant and the
        allocation it is in: `token` for the tracker and the origin (which honour it while the
        node stays in that allocation, for that node only), `peer_token` for the tenant's peers
        (which see it, so it opens nothing else)."""
        if self._issuer is None:
            return {"token": None, "peer_token": None}
        return {
            name: self._issuer.mint(
                swarm_audience(req.swarm),
                subject=f"node:{node.node_id}",
                role=role,
                tenant=req.tenant_id,
                allocation=node.allocation_id,
                ttl_s=SWARM_TOKEN_TTL_S,
            )
            for name, role in (("token", SWARM_MEMBER), ("peer_token", SWARM_PEER))
        }

    def _tracker(self) -> TrackerClient:
        token = self._issuer.mint(TRACKER_AUDIENCE) if self._issuer is not None else None
        return TrackerClient(self.tracker_url, token=token)

    async def aclose(self) -> None:
        if self._owns_agents:  # the worker's own client is the worker's to close
            await self._agents.aclose()

    # Target and swarm -----------------------------------------------------------------------

    @activity.defn
    def resolve_rollout_targets(self, req: ResolveTargetsInput) -> ResolvedTargets:
        """An allocation's nodes, or the tenant's serving fleet (every node it holds in a live
        allocation); only nodes that hold the tenant's workload are ever targets."""
        from gpucloud.models.tables import Node

        if self._db is None:
            raise ApplicationError(
                "this worker has no control-plane DB to resolve a target", type="TargetUnresolvable", non_retryable=True
            )
        query = select(Node).where(col(Node.tenant_id) == req.tenant_id)
        if req.allocation_id is not None:
            query = query.where(col(Node.allocation_id) == req.allocation_id)
        else:
            query = query.where(col(Node.allocation_id).is_not(None))
        with self._db.session() as session:
            nodes = session.exec(query.order_by(col(Node.rack), col(Node.id))).all()
        if not nodes:
            raise ApplicationError(
                f"no nodes of tenant {req.tenant_id} match the target", type="TargetUnresolvable", non_retryable=True
            )
        return ResolvedTargets(
            nodes=[
                RolloutTarget(
                    node_id=n.id, agent_url=n.agent_url, rack=n.rack, site=n.region, allocation_id=n.allocation_id
                )
                for n in nodes
            ]
        )

    def _still_held(self, req: WaveInput, nodes: list[RolloutTarget]) -> tuple[list[RolloutTarget], dict[str, str]]:
        """The nodes still in the rollout tenant's allocation, each naming the allocation it is in
        now, and why each other one is dropped (module doc)."""
        if self._db is None:
            return nodes, {}
        with self._db.session() as session:
            now = holdings(session, [n.node_id for n in nodes])
        kept, dropped = [], {}
        for node in nodes:
            if reason := _why_dropped(node, now.get(node.node_id), req.tenant_id):
                dropped[node.node_id] = reason
            else:
                kept.append(node.model_copy(update={"allocation_id": now[node.node_id].allocation_id}))
        return kept, dropped

    def _signed_manifest(self, tenant_id: str, digest: str) -> SignedManifest:
        key = (tenant_id, digest)
        if key not in self._signed:
            try:
                self._signed[key] = self._manifests(tenant_id).get(digest)
            except VersionNotFoundError as exc:
                raise ApplicationError(str(exc), type="VersionNotFound", non_retryable=True) from None
        return self._signed[key]

    def _tenant_keys(self, tenant_id: str) -> list[str]:
        """The keys the tenant's manifests are signed with, sent with a prefetch: a real node
        keeps no keyring of its own (`gpucloud.agent.tenant_weights.SentKeys`)."""
        if self._db is None:
            return []
        with self._db.session() as session:
            return active_public_keys(session, tenant_id)

    @activity.defn
    def prepare_rollout(self, req: PrepareInput) -> Prepared:
        """Register the rollout's swarm (every target node, every chunk) with the tracker; the
        same spec again is a no-op, so a retry is safe."""
        signed = self._signed_manifest(req.tenant_id, req.model_version)
        nodes = {n.node_id: PeerPlace(rack=n.rack, site=n.site, url=n.agent_url) for n in req.nodes}
        chunks = sorted(signed.manifest.chunk_ids())
        tracker = self._tracker()
        try:
            tracker.register_swarm(req.rollout_id, SwarmSpec(nodes=nodes, chunks=chunks, tenant=req.tenant_id))
        finally:
            tracker.close()
        return Prepared(swarm=req.rollout_id, chunks=len(chunks), total_bytes=signed.manifest.total_size)

    @activity.defn
    def end_rollout(self, swarm: str) -> None:
        """Remove the rollout's swarm from the tracker (its nodes' tokens open nothing more);
        removing one that is gone already does nothing."""
        tracker = self._tracker()
        try:
            tracker.remove_swarm(swarm)
        finally:
            tracker.close()

    # Wave steps -----------------------------------------------------------------------------

    async def _each(
        self, req: WaveInput, step: str, call: Callable[[RolloutTarget], Awaitable[NodeOutcome]]
    ) -> WaveResult:
        """`call` on every node of the wave still the tenant's (the others are dropped, unsent)."""
        nodes, dropped = await asyncio.to_thread(self._still_held, req, req.nodes)

        async def guarded(node: RolloutTarget) -> NodeOutcome | None:
            try:
                return await call(node)
            except _Dropped as exc:
                dropped[node.node_id] = str(exc)
                return None
            except httpx.HTTPError as exc:
                return NodeOutcome(
                    node_id=node.node_id, ok=False, detail=f"{step}: agent unreachable: {type(exc).__name__}: {exc}"
                )

        async def beat() -> None:
            while True:
                await asyncio.sleep(HEARTBEAT_S)
                activity.heartbeat(step)

        beating = asyncio.create_task(beat())
        try:
            answered = await asyncio.gather(*(guarded(n) for n in nodes))
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating
        outcomes = [o for o in answered if o is not None]
        for outcome in outcomes:
            metrics.ROLLOUT_NODE_STEPS.labels(step, "ok" if outcome.ok else "failed").inc()
        metrics.ROLLOUT_NODE_STEPS.labels(step, "dropped").inc(len(dropped))
        if step == "check":
            metrics.ROLLOUT_WAVES.labels("passed" if all(o.ok for o in outcomes) else "failed").inc()
        return WaveResult(outcomes=outcomes, dropped=dropped)

    async def _post(self, node: RolloutTarget, path: str, body: dict, step: str) -> NodeOutcome:
        response = await self._agents.call(
            "POST", node.agent_url, path, node_id=node.node_id, json=body, timeout_s=self._request_timeout_s
        )
        if response.status_code != 200:
            return NodeOutcome(node_id=node.node_id, ok=False, detail=f"{step}: {_detail(response)}")
        state = response.json()
        return NodeOutcome(node_id=node.node_id, ok=True, active=state.get("active"), previous=state.get("previous"))

    @activity.defn
    async def prefetch_wave(self, req: WaveInput) -> WaveResult:
        """Fetch and assemble the version on every node of the wave; raises (so Temporal retries)
        unless every node has it."""
        signed = await asyncio.to_thread(self._signed_manifest, req.tenant_id, req.model_version)
        keys = await asyncio.to_thread(self._tenant_keys, req.tenant_id)
        body = {
            "signed": signed.model_dump(mode="json"),
            "tracker_url": self.tracker_url,
            "swarm": req.swarm,
            "keys": keys,
        }

        async def one(node: RolloutTarget) -> NodeOutcome:
            own = body | self._swarm_tokens(req, node)
            return await self._post(node, "/weights/prefetch", own, "prefetch")

        result = await self._each(req, "prefetch", one)
        if failed := result.failed:
            raise ApplicationError(
                f"prefetch failed on {len(failed)} nodes: {failed[0].node_id}: {failed[0].detail}",
                type="PrefetchIncomplete",
            )
        return result

    @activity.defn
    async def verify_wave(self, req: WaveInput) -> WaveResult:
        body = {"digest": req.model_version}
        return await self._each(req, "verify", lambda node: self._post(node, "/weights/verify", body, "verify"))

    @activity.defn
    async def activate_wave(self, req: WaveInput) -> WaveResult:
        body = {"digest": req.model_version}

        async def one(node: RolloutTarget) -> NodeOutcome:
            outcome = await self._post(node, "/weights/activate", body, "activate")
            if outcome.ok and outcome.active != req.model_version:
                return outcome.model_copy(update={"ok": False, "detail": f"activate: {outcome.active} is active"})
            return outcome

        return await self._each(req, "activate", one)

    @activity.defn
    async def check_wave(self, req: WaveInput) -> WaveResult:
        """Health and the evaluation probe on every node of the wave, against the thresholds."""
        limits = req.thresholds

        async def one(node: RolloutTarget) -> NodeOutcome:
            response = await self._agents.call(
                "GET", node.agent_url, "/weights/check", node_id=node.node_id, params={"digest": req.model_version}
            )
            if response.status_code != 200:
                return NodeOutcome(node_id=node.node_id, ok=False, detail=f"check: {_detail(response)}")
            got = response.json()
            outcome = NodeOutcome(
                node_id=node.node_id,
                ok=True,
                active=got["active"],
                previous=got["previous"],
                healthy=got["healthy"],
                eval_score=got["eval_score"],
            )
            if got["active"] != req.model_version:
                return outcome.model_copy(
                    update={"ok": False, "detail": f"{got['active']} is active, not the rollout's"}
                )
            if limits.require_healthy and not got["healthy"]:
                return outcome.model_copy(update={"ok": False, "detail": f"unhealthy: {got['health_detail']}"})
            if got["eval_score"] is None or got["eval_score"] < limits.min_eval_score:
                return outcome.model_copy(
                    update={
                        "ok": False,
                        "detail": f"evaluation probe scored {got['eval_score']} < {limits.min_eval_score}",
                    }
                )
            if req.evaluation is not None:
                return await self._evaluate(node, req, req.evaluation, outcome)
            return outcome

        return await self._each(req, "check", one)

    async def _evaluate(
        self, node: RolloutTarget, req: WaveInput, evaluation: RolloutEvaluation, outcome: NodeOutcome
    ) -> NodeOutcome:
        """The model's evaluations on the node's active version, held to the model's gates (their
        ranges: a node has no production results to measure a regression against). The node is
        read again first: the command is the tenant's, and the probe before took a while."""
        if dropped := (await asyncio.to_thread(self._still_held, req, [node]))[1]:
            raise _Dropped(dropped[node.node_id])
        body = {
            "digest": req.model_version,
            "evaluators": evaluation.evaluators,
            "command": evaluation.command.model_dump(mode="json") if evaluation.command else None,
        }
        response = await self._agents.call(
            "POST",
            node.agent_url,
            "/weights/evaluate",
            node_id=node.node_id,
            json=body,
            timeout_s=self._request_timeout_s,
        )
        if response.status_code != 200:
            return outcome.model_copy(update={"ok": False, "detail": f"evaluate: {_detail(response)}"})
        found = response.json()["outcomes"]
        results = {name: o["results"] for name, o in found.items() if o["failure"] is None}
        errors = {name: o["failure"] for name, o in found.items() if o["failure"] is not None}
        outcome = outcome.model_copy(update={"evaluations": results})
        if failures := evaluate_gates(evaluation.gates, results, None, errors=errors):
            detail = "gates failed on the node: " + "; ".join(f.describe() for f in failures)
            return outcome.model_copy(update={"ok": False, "detail": detail})
        return outcome

    @activity.defn
    async def rollback_wave(self, req: WaveInput) -> WaveResult:
        """Switch every node of the list off the rollout's version (a no-op where it is not
        active); raises until every node answered, so Temporal retries it for as long as it takes."""
        body = {"digest": req.model_version}
        result = await self._each(req, "rollback", lambda node: self._post(node, "/weights/rollback", body, "rollback"))
        if unreachable := [o for o in result.failed if "unreachable" in o.detail]:
            raise ApplicationError(
                f"rollback not confirmed by {len(unreachable)} nodes: "
                f"{unreachable[0].node_id}: {unreachable[0].detail}",
                type="RollbackIncomplete",
            )
        return result
