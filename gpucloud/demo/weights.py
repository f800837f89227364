"""The weight-registry part of `gpucloud demo`: a push of a real (fp32 and fp16) model, a fine-tune
pushed with dedup, both evaluated by the platform's weight-sanity evaluator and promoted; then a
bad candidate (a fine-tune with one NaN weight) that the same evaluator finds and the gates refuse,
with its table; then a pull that a corrupted chunk stops, and a clean pull.

Everything goes through the public API with the tenant's key, exactly as `gpucloud weights` does;
the evaluations run in the worker and are signed with the platform's evaluator key.
The corrupted pull corrupts one chunk in transit (between the registry and the client) rather than
in the registry's store, so the demo works against any backend and shows the property that
matters: the client itself refuses bytes that do not match the signed manifest.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from safetensors.numpy import save_file

from gpucloud.cli.evaluation import evaluation_table
from gpucloud.cli.weights import failing_metrics_table, pull_with_progress, push_with_progress
from gpucloud.client.base import ApiError
from gpucloud.client.registry import RegistryClient, signer_for
from gpucloud.demo.common import DemoFailed
from gpucloud.registry.chunking import ChunkPolicy, MiB
from gpucloud.registry.manifest import IntegrityError, Lineage

TENSORS = 20
TENSOR_SHAPE = (256, 512)  # 512 KiB of fp32
# Chunks well below the production 64 MiB, so a 10 MiB demo model still has tensor-sized chunks.
DEMO_POLICY = ChunkPolicy(max_chunk_size=1 * MiB, pack_size=64 * 1024, fixed_chunk_size=1 * MiB, read_size=1 * MiB)
# What the platform's sanity evaluator must find before a version reaches staging or production.
GATES = [
    {"metric": "nan_inf_count", "max": 0},
    {"metric": "max_rel_norm_change", "max": 0.5},
    {"metric": "shape_changes", "max": 0},
]
EVALUATION_WAIT_S = 120.0


@dataclass(frozen=True)
class PushedVersions:
    model: str
    first: str  # v1's digest
    production: str  # v2's digest, promoted to production
    bad: str  # v3's digest: a fine-tune of v2 with one NaN weight, refused by the sanity gate


class _CorruptInTransit(RegistryClient):
    """Real HTTP, except that one byte of one chunk is flipped on its way to the puller."""

    def __init__(self, api_url: str, api_key: str, chunk_id: str) -> None:
        super().__init__(api_url, api_key)
        self.victim = chunk_id

    def chunk_pieces(self, model: str, chunk_id: str) -> Iterator[memoryview]:
        for index, piece in enumerate(super().chunk_pieces(model, chunk_id)):
            if chunk_id == self.victim and index == 0:
                piece[len(piece) // 2] ^= 0x01
            yield piece


def _write_model(directory: Path, tensors: list[np.ndarray]) -> Path:
    directory.mkdir(parents=True)
    save_file({f"layers.{i}.weight": t for i, t in enumerate(tensors)}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"architecture": "demo", "layers": len(tensors)}))
    return directory


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _promote(console: Console, client: RegistryClient, model: str, digest: str, *, expect_refusal: bool) -> None:
    try:
        client.promote(model, digest, "production")
    except ApiError as exc:
        if not expect_refusal or exc.type != "gates-failed":
            raise DemoFailed(f"promotion of {digest[:12]} to production failed: {exc}") from exc
        failing = {(f["metric"], f["evaluator"]) for f in exc.body.get("failing_metrics", [])}
        if failing != {("nan_inf_count", "sanity")}:
            raise DemoFailed(f"gates refused for {sorted(failing)}, expected nan_inf_count of sanity") from exc
        console.print(failing_metrics_table(exc.body["failing_metrics"]))
        console.print(f"  [yellow]refused[/], as it should be: {exc.body['detail']}")
        return
    if expect_refusal:
        raise DemoFailed(f"{digest[:12]} holds a NaN weight, yet the gates let it into production")
    console.print(f"  {model}@production -> {digest[:12]}")


def _evaluate(console: Console, client: RegistryClient, model: str, digest: str) -> dict:
    """The platform's sanity evaluation of a version, shown as its table: the record it kept."""
    with console.status(f"the platform evaluates {digest[:12]} (weight sanity)"):
        _, record = client.evaluate_and_wait(model, digest, "sanity", timeout_s=EVALUATION_WAIT_S)
    against = (record.get("details") or {}).get("compared_with")
    title = f"weight sanity of {digest[:12]}" + (f" against {against[:12]}" if against else "") + ", platform-signed"
    console.print(evaluation_table(title, record, client.get(f"/v1/models/{model}")["gates"]))
    if record.get("error"):
        raise DemoFailed(f"the sanity evaluation of {digest[:12]} failed: {record['error']}")
    return record


def demo_weights(console: Console, api_url: str, api_key: str, data_dir: Path) -> PushedVersions:
    """Run the registry scenario against the API at api_url as the tenant whose key is api_key."""
    work = Path(data_dir) / "demo-weights" / uuid.uuid4().hex[:8]
    model = f"demo-llm-{work.name}"
    rng = np.random.default_rng()
    with RegistryClient(api_url, api_key) as client:
        signer = signer_for(Path(data_dir), client.signing_keys()[0])
        client.ensure_model(model)
        client.set_gates(model, GATES)

        console.rule("weights: push v1, evaluated by the platform")
        tensors = [(rng.standard_normal(TENSOR_SHAPE) * 0.02).astype(np.float32) for _ in range(TENSORS)]
        v1_dir = _write_model(work / "v1", tensors)
        v1 = push_with_progress(client, v1_dir, model=model, signer=signer, console=console, policy=DEMO_POLICY)
        _evaluate(console, client, model, v1.digest)
        _promote(console, client, model, v1.digest, expect_refusal=False)

        console.rule("weights: a fine-tune changes 10% of the tensors")
        for i in (3, 11):
            tensors[i] = tensors[i] * np.float32(1.05)
        v2_dir = _write_model(work / "v2", tensors)
        v2 = push_with_progress(
            client,
            v2_dir,
            model=model,
            signer=signer,
            console=console,
            policy=DEMO_POLICY,
            lineage=Lineage(parent=v1.digest, training_run="demo-finetune"),
        )
        if v2.stats.bytes_uploaded > 0.15 * v2.stats.bytes_total:
            raise DemoFailed(
                f"the fine-tune uploaded {v2.stats.bytes_uploaded} of {v2.stats.bytes_total} "
                "bytes; dedup should have skipped about 90%"
            )
        _evaluate(console, client, model, v2.digest)
        _promote(console, client, model, v2.digest, expect_refusal=False)

        console.rule("weights: a bad candidate (one NaN weight), refused by the sanity gate")
        tensors[7] = tensors[7].copy()
        tensors[7][100, 200] = np.nan
        v3 = push_with_progress(
            client,
            _write_model(work / "v3", tensors),
            model=model,
            signer=signer,
            console=console,
            policy=DEMO_POLICY,
            lineage=Lineage(parent=v2.digest, training_run="demo-finetune-diverged"),
        )
        found = _evaluate(console, client, model, v3.digest)
        if found["results"].get("nan_inf_count") != 1:
            raise DemoFailed(f"the sanity evaluator counted {found['results'].get('nan_inf_count')} NaN, not 1")
        client.promote(model, v3.digest, "candidate")
        _promote(console, client, model, v3.digest, expect_refusal=True)

        console.rule("weights: a chunk corrupted in transit")
        victim = v2.signed.manifest.files["model.safetensors"].chunks[4].id
        bad_dest = work / "pulled-corrupt"
        with _CorruptInTransit(api_url, api_key, victim) as tampered:
            try:
                pull_with_progress(tampered, model, "production", bad_dest, console=console, keys_dir=Path(data_dir))
            except IntegrityError as exc:
                console.print(f"  [yellow]refused[/] ({type(exc).__name__}): {exc}")
            else:
                raise DemoFailed("a pull with a corrupted chunk completed")
        if bad_dest.exists() or any(p.name.startswith(f".{bad_dest.name}") for p in work.iterdir()):
            raise DemoFailed(f"the refused pull left files behind at {bad_dest}")

        console.rule("weights: clean pull of production")
        pulled = pull_with_progress(
            client, model, "production", work / "pulled", console=console, keys_dir=Path(data_dir)
        )
        if _tree(pulled.path) != _tree(v2_dir):
            raise DemoFailed("the pulled production version differs from what was pushed")
    return PushedVersions(model=model, first=v1.digest, production=v2.digest, bad=v3.digest)
