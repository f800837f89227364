"""`gpucloud prepare` against what an operator starts with: a bare Temporal server (no
namespace, no search attributes), an S3 server with no bucket, and a fresh data dir. The first
run creates each item; the second finds each present and changes nothing; what it cannot reach
it refuses by name, with exit 1."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpucloud.cli.main import app
from gpucloud.devstack.stack import free_port
from gpucloud.ledger.db import LedgerDatabase
from gpucloud.ledger.pricebook import list_versions
from support.s3 import CREDENTIALS, s3_client

pytestmark = pytest.mark.integration


def env_for(tmp_path: Path, temporal: str, namespace: str, s3: str, bucket: str) -> dict[str, str]:
    (tmp_path / "no-secrets").mkdir(exist_ok=True)
    return {
        "GPUCLOUD_DATA_DIR": str(tmp_path / "data"),
        "GPUCLOUD_SECRETS_DIR": str(tmp_path / "no-secrets"),
        "GPUCLOUD_TEMPORAL__ADDRESS": temporal,
        "GPUCLOUD_TEMPORAL__NAMESPACE": namespace,
        "GPUCLOUD_OBJECT_STORE__BACKEND": "s3",
        "GPUCLOUD_OBJECT_STORE__BUCKET": bucket,
        "GPUCLOUD_OBJECT_STORE__ENDPOINT_URL": s3,
        "GPUCLOUD_OBJECT_STORE__REGION": CREDENTIALS["region_name"],
        "GPUCLOUD_OBJECT_STORE__ACCESS_KEY_ID": CREDENTIALS["aws_access_key_id"],
        "GPUCLOUD_OBJECT_STORE__SECRET_ACCESS_KEY": CREDENTIALS["aws_secret_access_key"],
    }


def run_prepare(env: dict[str, str]) -> tuple[int, dict[str, tuple[str, str]], str]:
    result = CliRunner().invoke(app, ["prepare", "--output", "json"], env=env)
    assert result.stdout, (result.output, result.exception)
    rows = json.loads(result.stdout.splitlines()[0])
    return result.exit_code, {r["item"]: (r["outcome"], r["detail"]) for r in rows}, result.output


ITEMS = {
    "control-plane schema",
    "ledger schema",
    "issuer key",
    "operator token",
    "page token secret",
    "agent credential secret",
    "storage master key",
    "Temporal payload keys",
    "evaluator key",
    "metrics token",
    "API delegate",
    "Temporal namespace",
    "search attributes",
    "object store",
    "price book",
}


def test_prepare_creates_what_is_missing_then_finds_it_all_present(
    tmp_path: Path, bare_temporal: str, s3_endpoint: str
) -> None:
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
    from temporalio.client import Client

    namespace = f"prep-{uuid.uuid4().hex[:8]}"
    bucket = f"prep-{uuid.uuid4().hex[:8]}"
    env = env_for(tmp_path, bare_temporal, namespace, s3_endpoint, bucket)

    code, first, output = run_prepare(env)
    assert code == 0, output
    assert set(first) == ITEMS
    assert {outcome for outcome, _ in first.values()} == {"created"}, first
    # Where each secret lives is said; the secret itself never appears.
    operator_token = (tmp_path / "data" / "operator_token").read_text().strip()
    assert str(tmp_path / "data" / "operator_token") in first["operator token"][1]
    assert operator_token not in output
    assert (tmp_path / "data" / "issuer_key.pub").exists()

    async def listed_attributes() -> set[str]:
        client = await Client.connect(bare_temporal, namespace=namespace)
        request = ListSearchAttributesRequest(namespace=namespace)
        return set((await client.operator_service.list_search_attributes(request)).custom_attributes)

    assert {"NodeId", "NodeState", "TenantId", "AllocationId", "ModelVersion"} <= asyncio.run(listed_attributes())
    s3_client(s3_endpoint).head_bucket(Bucket=bucket)
    ledger = LedgerDatabase(f"sqlite:///{tmp_path / 'data' / 'ledger.db'}")
    with ledger.engine.connect() as connection:
        assert len(list_versions(connection)) == 1
    ledger.dispose()

    secrets_before = {p.name: p.read_bytes() for p in (tmp_path / "data").iterdir() if p.is_file()}
    code, second, output = run_prepare(env)
    assert code == 0, output
    assert {item: outcome for item, (outcome, _) in second.items()} == dict.fromkeys(ITEMS, "present")
    secrets_after = {p.name: p.read_bytes() for p in (tmp_path / "data").iterdir() if p.is_file()}
    assert {k: v for k, v in secrets_after.items() if not k.endswith((".db", "-wal", "-shm"))} == {
        k: v for k, v in secrets_before.items() if not k.endswith((".db", "-wal", "-shm"))
    }


def test_readiness_names_a_missing_namespace_and_search_attributes_until_prepared(
    tmp_path: Path, bare_temporal: str, s3_endpoint: str
) -> None:
    from google.protobuf.duration_pb2 import Duration
    from temporalio.api.workflowservice.v1 import RegisterNamespaceRequest
    from temporalio.client import Client

    from gpucloud.web.readiness import temporal_check

    namespace = f"prep-{uuid.uuid4().hex[:8]}"

    async def ready() -> str:
        client = await Client.connect(bare_temporal, namespace=namespace)
        try:
            await temporal_check(lambda: client)()
        except RuntimeError as exc:
            return str(exc)
        return "ok"

    async def registered_without_attributes() -> str:
        client = await Client.connect(bare_temporal, namespace=namespace)
        retention = Duration(seconds=86400)
        request = RegisterNamespaceRequest(namespace=namespace, workflow_execution_retention_period=retention)
        await client.workflow_service.register_namespace(request)
        for _ in range(100):  # until the frontends' namespace cache has it (seconds)
            if "not found" not in (found := await ready()):
                return found
            await asyncio.sleep(0.2)
        return found

    not_found = f"namespace {namespace} not found: run `gpucloud prepare`"
    assert asyncio.run(ready()) == not_found
    assert "search attributes AllocationId, ModelVersion, NodeId" in asyncio.run(registered_without_attributes())
    code, _, output = run_prepare(env_for(tmp_path, bare_temporal, namespace, s3_endpoint, f"prep-{namespace}"))
    assert code == 0, output
    assert asyncio.run(ready()) == "ok"


def test_prepare_refuses_by_name_what_it_cannot_reach(tmp_path: Path) -> None:
    env = env_for(tmp_path, f"127.0.0.1:{free_port()}", "gpucloud", f"http://127.0.0.1:{free_port()}", "nowhere")
    result = CliRunner().invoke(app, ["prepare"], env={**env, "COLUMNS": "200"})
    assert result.exit_code == 1, result.output
    assert "not prepared: Temporal, object store" in result.output
    assert "refused" in result.output and "does not answer" in result.output
