"""The rollouts API on the production app and worker: bad input is a 4xx naming the field, a
tenant rolls out only its own versions to its own nodes, creation is idempotent, and another
tenant cannot see or steer a rollout (404, like one that does not exist)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import uuid

import pytest
from sqlmodel import Session, select
from typer.testing import CliRunner

from gpucloud.cli.main import app
from gpucloud.client.registry import RegistryClient, RegistryPushTarget, signer_for
from gpucloud.db import get_engine
from gpucloud.models.registry_tables import ModelAlias, ModelVersion
from gpucloud.registry.chunking import encode_safetensors_header
from gpucloud.registry.push import push
from support.stack import async_wait_until

pytestmark = pytest.mark.integration


def _push_version(h, tenant_id: str, key: str, tmp_path) -> str:
    source = tmp_path / "model"
    source.mkdir()
    tensors = {"layer.0": os.urandom(3000), "layer.1": os.urandom(2000)}
    header = encode_safetensors_header((name, len(data)) for name, data in tensors.items())
    (source / "model.safetensors").write_bytes(header + b"".join(tensors.values()))
    with RegistryClient(h.settings.api_url, key) as client:
        return push(
            source, model="m", target=RegistryPushTarget(client), signer=signer_for(tmp_path / "keys", tenant_id)
        ).digest


async def test_rollouts_api_validates_scopes_and_is_idempotent(ready_fleet, tmp_path):
    h = await ready_fleet(nodes=4, latency_scale=0.02)
    a_id, a_key = await h.onboard()
    _, b_key = await h.onboard()
    with h.client(a_key) as a, h.client(b_key) as b:
        alloc = a.post("/v1/allocations", json={"gpu_type": "H100", "node_count": 2, "region": "us-east-1"})
        assert alloc.status_code == 202, alloc.text
        alloc_id = alloc.json()["allocation"]["id"]
        ready = await h.wait_allocation(a_key, alloc_id, "ready")
        digest = _push_version(h, a_id, a_key, tmp_path)
        others = [n["id"] for n in h.nodes() if n["id"] not in ready["node_ids"]]

        bad = a.post("/v1/rollouts", json={"model_version": "not-a-digest", "allocation_id": alloc_id})
        assert bad.status_code == 422 and "model_version" in bad.text
        unknown = a.post("/v1/rollouts", json={"model_version": "0" * 64, "allocation_id": alloc_id})
        assert unknown.status_code == 422 and "no version" in unknown.json()["detail"]
        assert unknown.json()["errors"][0]["field"] == "model_version"  # the field, as any 422 names it
        # B's registry does not hold A's version.
        assert b.post("/v1/rollouts", json={"model_version": digest}).status_code == 422
        foreign = a.post("/v1/rollouts", json={"model_version": digest, "node_ids": others[:1]})
        assert foreign.status_code == 422 and others[0] in foreign.json()["detail"]
        assert foreign.json()["errors"][0]["field"] == "node_ids"

        body = {"model_version": digest, "allocation_id": alloc_id, "bake_s": 0}
        idem = {"Idempotency-Key": str(uuid.uuid4())}
        first = a.post("/v1/rollouts", json=body, headers=idem)
        assert first.status_code == 202, first.text
        rollout_id = first.json()["rollout_id"]
        again = a.post("/v1/rollouts", json=body, headers=idem)
        assert again.status_code == 202 and again.json()["rollout_id"] == rollout_id

        # Reads query the workflow, which the in-process worker answers on this event loop: off it.
        mine = await asyncio.to_thread(a.get, f"/v1/rollouts/{rollout_id}")
        assert mine.status_code == 200 and mine.json()["tenant_id"] == a_id
        assert mine.json()["model_version"] == digest
        assert (await asyncio.to_thread(b.get, f"/v1/rollouts/{rollout_id}")).status_code == 404
        assert (await asyncio.to_thread(b.post, f"/v1/rollouts/{rollout_id}:abort")).status_code == 404
        assert (await asyncio.to_thread(a.get, "/v1/rollouts/rollout-0000000000000000")).status_code == 404
        assert a.get("/v1/rollouts/node-x").status_code == 404


async def test_rollout_refs_one_active_rollout_per_ready_allocation_and_the_promotion_warning(
    ready_fleet, temporal_env, tmp_path
):
    """A version named MODEL@ALIAS or MODEL@PREFIX is recorded as its digest; a second rollout on
    an allocation one runs on is refused naming it (of two at once, one wins); a rollout to an
    allocation that is not ready is refused naming its status; an unpromoted version warns."""
    h = await ready_fleet(nodes=4, latency_scale=0.02)
    a_id, a_key = await h.onboard()
    env = {
        "GPUCLOUD_API__PORT": str(h.settings.api.port),
        "GPUCLOUD_DATA_DIR": str(h.settings.data_dir),
        "GPUCLOUD_API_KEY": a_key,
        "COLUMNS": "400",
    }
    with h.client(a_key) as a:
        allocs = []
        for _ in range(2):
            made = a.post("/v1/allocations", json={"gpu_type": "H100", "node_count": 2, "region": "us-east-1"})
            assert made.status_code == 202, made.text
            allocs.append(made.json()["allocation"]["id"])
        for alloc_id in allocs:
            await h.wait_allocation(a_key, alloc_id, "ready")
        first_alloc, second_alloc = allocs
        digest = _push_version(h, a_id, a_key, tmp_path)
        with RegistryClient(h.settings.api_url, a_key) as registry:
            registry.promote("m", digest, "candidate")

        async def create(version: str, alloc_id: str, **extra):
            # Off the event loop: a create asks the rollout holding the allocation (the in-process
            # worker, on this loop) for its progress.
            body = {"model_version": version, "allocation_id": alloc_id, "bake_s": 3600, **extra}
            return await asyncio.to_thread(a.post, "/v1/rollouts", json=body)

        # Refs the registry does not resolve: 404 naming what is missing; a malformed ref: 422.
        assert (await create("m@production", first_alloc)).status_code == 404
        assert (await create("nope@candidate", first_alloc)).status_code == 404
        other = ("0" if digest[0] != "0" else "1") + digest[1:12]
        assert (await create(f"m@{other}", first_alloc)).status_code == 404
        bad = await create("m@xyz", first_alloc)
        assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "model_version"

        # The CLI takes the alias, prints the warning, and the rollout records the digest.
        started = await asyncio.to_thread(
            CliRunner().invoke,
            app,
            ["rollout", "start", "m@candidate", "--allocation", first_alloc, "--bake", "3600", "--no-watch"],
            env=env,
        )
        assert started.exit_code == 0, started.output
        assert "warning:" in started.output and "not promoted to production" in started.output
        assert "m has no production alias" in started.output
        match = re.search(r"rollout (rollout-[0-9a-f]{16}) of ([0-9a-f]{64}) started", started.output)
        assert match and match.group(2) == digest, started.output
        running = match.group(1)
        shown = await asyncio.to_thread(a.get, f"/v1/rollouts/{running}")
        assert shown.status_code == 200 and shown.json()["model_version"] == digest

        # A second rollout on the same allocation, by a digest prefix: 409 naming the running one.
        second = await create(f"m@{digest[:12]}", first_alloc)
        assert second.status_code == 409, second.text
        assert second.json()["rollout_id"] == running and running in second.json()["detail"]
        # By nodes of that allocation: the same.
        nodes = a.get(f"/v1/allocations/{first_alloc}").json()["node_ids"]
        by_nodes = await asyncio.to_thread(
            a.post, "/v1/rollouts", json={"model_version": digest, "node_ids": nodes[:1], "bake_s": 3600}
        )
        assert by_nodes.status_code == 409 and by_nodes.json()["rollout_id"] == running

        # Two creates at once on the other allocation: exactly one wins, the other names it.
        answers = await asyncio.gather(create(digest, second_alloc), create(digest, second_alloc))
        assert sorted(r.status_code for r in answers) == [202, 409], [r.text for r in answers]
        won = next(r for r in answers if r.status_code == 202).json()
        lost = next(r for r in answers if r.status_code == 409).json()
        assert lost["rollout_id"] == won["rollout_id"]
        assert won["progress"]["model_version"] == digest and "not promoted" in won["warnings"][0]

        # Once the running rollout has ended (here its workflow is terminated: this harness has no
        # tracker, so the rollout never gets past preparing), the allocation takes the next one.
        await temporal_env.client.get_workflow_handle(running).terminate("the test ends it")
        after = await create(f"m@{digest[:12]}", first_alloc, bake_s=0)
        assert after.status_code == 202, after.text
        assert after.json()["progress"]["model_version"] == digest

        # Promoted to production (written as a promotion would, skipping its gates).
        with Session(get_engine(h.settings.database_url)) as session:
            version = session.exec(select(ModelVersion).where(ModelVersion.digest == digest)).one()
            session.add(ModelAlias(model_id=version.model_id, name="production", version=digest, moved_by="test"))
            # A second version sharing the first 12 digits makes that prefix ambiguous: 422 naming both.
            twin = digest[:12] + ("f" if digest[12] != "f" else "e") + digest[13:]
            twin_row = version.model_dump(exclude={"seq", "digest", "content_digest"})  # other files, same prefix
            session.add(ModelVersion(**twin_row, digest=twin, content_digest=None))
            session.commit()
        ambiguous = await create(f"m@{digest[:12]}", second_alloc)
        assert ambiguous.status_code == 422, ambiguous.text
        assert digest in ambiguous.json()["detail"] and twin in ambiguous.json()["detail"]

        # The version the production alias names, by that alias: no warning.
        await temporal_env.client.get_workflow_handle(won["rollout_id"]).terminate("the test ends it")
        promoted = await create("m@production", second_alloc, bake_s=0)
        assert promoted.status_code == 202 and promoted.json()["warnings"] == [], promoted.text
        await temporal_env.client.get_workflow_handle(promoted.json()["rollout_id"]).terminate("the test ends it")
        # An allocation that is not ready: 409 naming its status, before anything starts.
        assert a.post(f"/v1/allocations/{second_alloc}/cancel").status_code in (200, 202)
        refused = await create(digest, second_alloc)
        assert refused.status_code == 409, refused.text
        assert refused.json()["allocation_status"] in ("cancelling", "released")
        assert refused.json()["allocation_status"] in refused.json()["detail"]

        # The tenant's rollouts, newest first (the running one, then by when they ended), in pages.
        ended = [promoted.json()["rollout_id"], won["rollout_id"], running]
        expected = [after.json()["rollout_id"], *ended]

        def listed():
            ids = [r["rollout_id"] for r in a.get("/v1/rollouts", params={"page_size": 100}).json()["items"]]
            return ids if ids == expected else None

        await async_wait_until(listed, timeout_s=30, interval_s=0.2, what="the rollouts listed")
        first_page = a.get("/v1/rollouts", params={"page_size": 2}).json()
        assert [r["rollout_id"] for r in first_page["items"]] == expected[:2] and first_page["next_page_token"]
        assert first_page["items"][0]["status"] == "running"
        assert first_page["items"][0]["model_version"] == digest
        assert first_page["items"][0]["allocation_id"] == first_alloc
        rest = a.get("/v1/rollouts", params={"page_size": 2, "page_token": first_page["next_page_token"]}).json()
        assert [r["rollout_id"] for r in rest["items"]] == expected[2:]
        token = first_page["next_page_token"]
        middle = len(token) // 2  # not the last characters, which may be base64's unused bits
        tampered = token[:middle] + ("A" if token[middle] != "A" else "B") + token[middle + 1 :]
        forged = a.get("/v1/rollouts", params={"page_token": tampered})
        assert forged.status_code == 400
        _, b_key = await h.onboard()
        with h.client(b_key) as b:
            assert b.get("/v1/rollouts").json()["items"] == []  # another tenant sees none of them
        table = await asyncio.to_thread(CliRunner().invoke, app, ["rollout", "list"], env=env)
        assert table.exit_code == 0, table.output
        assert all(rollout_id in table.output for rollout_id in expected), table.output  # ids in full
        assert digest in table.output
        as_json = await asyncio.to_thread(CliRunner().invoke, app, ["rollout", "list", "-o", "json"], env=env)
        assert [r["rollout_id"] for r in json.loads(as_json.stdout)] == expected


async def test_a_claim_whose_workflow_is_still_starting_holds_the_allocation_until_its_grace_ends(
    ready_fleet, temporal_env, tmp_path
):
    """A create commits its claim before it starts its workflow: a second create that finds the
    claim but no workflow yet is refused (the first is starting it), and a claim left by a
    create that died before its start gives way once the grace is over."""
    from datetime import timedelta

    from gpucloud.api.routers.rollouts import ROLLOUT_START_GRACE_S
    from gpucloud.models.tables import Allocation, utcnow

    h = await ready_fleet(nodes=2, latency_scale=0.02)
    a_id, a_key = await h.onboard()
    with h.client(a_key) as a:
        made = a.post("/v1/allocations", json={"gpu_type": "H100", "node_count": 1, "region": "us-east-1"})
        alloc_id = made.json()["allocation"]["id"]
        await h.wait_allocation(a_key, alloc_id, "ready")
        digest = _push_version(h, a_id, a_key, tmp_path)

        def claimed(seconds_ago: float) -> None:
            with Session(get_engine(h.settings.database_url)) as session:
                row = session.exec(select(Allocation).where(Allocation.id == alloc_id)).one()
                row.active_rollout_id = "rollout-starting"
                row.active_rollout_claimed_at = utcnow() - timedelta(seconds=seconds_ago)
                session.add(row)
                session.commit()

        def create():
            body = {"model_version": digest, "allocation_id": alloc_id, "bake_s": 0}
            return a.post("/v1/rollouts", json=body)

        claimed(1)
        starting = await asyncio.to_thread(create)
        assert starting.status_code == 409 and starting.json()["rollout_id"] == "rollout-starting", starting.text
        claimed(ROLLOUT_START_GRACE_S + 30)
        taken = await asyncio.to_thread(create)
        assert taken.status_code == 202, taken.text
        await temporal_env.client.get_workflow_handle(taken.json()["rollout_id"]).terminate("the test ends it")
