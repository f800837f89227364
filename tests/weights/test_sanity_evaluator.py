"""The weight-sanity evaluator on small real safetensors models (bf16, fp16, fp32 tensors,
a few MiB), read in chunks far smaller than a tensor."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from gpucloud.registry import sanity
from support.models import float_model as model

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(sanity, "CHUNK_BYTES", 64 << 10)  # a tensor spans many reads


def test_a_clean_fine_tune_passes_and_the_norms_are_exact(tmp_path: Path) -> None:
    parent = model(tmp_path / "base", np.random.default_rng(1))
    child = model(tmp_path / "tuned", np.random.default_rng(1), scale=1.01)
    report = sanity.evaluate(child, parent)
    metrics = report.metrics()
    assert metrics["nan_inf_count"] == 0 and metrics["shape_changes"] == 0 and metrics["tensor_count"] == 3
    assert 0.005 < metrics["max_rel_norm_change"] < 0.02  # everything scaled by 1.01
    assert metrics["tensors_added"] == metrics["tensors_removed"] == metrics["files_added"] == 0
    # fp32 norm against numpy's own; bf16 widened exactly.
    embed = np.random.default_rng(1).standard_normal((512, 1024)).astype(np.float32) * 1.01
    assert math.isclose(
        report.tensors["model-00001-of-00002.safetensors:embed.weight"].l2,
        float(np.linalg.norm(embed.astype(np.float64))),
        rel_tol=1e-6,  # squares summed in float32 per chunk, the chunks in float64
    )
    assert report.bytes_read == 512 * 1024 * 4 + 512 * 512 * 2 + 256 * 512 * 2


def test_a_nan_tensor_fails_the_sanity_metrics_and_is_named(tmp_path: Path) -> None:
    parent = model(tmp_path / "base", np.random.default_rng(1))
    child = model(tmp_path / "bad", np.random.default_rng(1), nan=True)
    report = sanity.evaluate(child, parent)
    assert report.metrics()["nan_inf_count"] == 1 and report.metrics()["nan_count"] == 1
    assert report.details()["nan_or_inf"] == ["model-00001-of-00002.safetensors:mlp.weight"]
    # The NaN is left out of the norm: the rest of the tensor is unchanged.
    assert report.metrics()["max_rel_norm_change"] < 1e-3


def test_shape_dtype_tensor_and_file_changes_against_the_parent(tmp_path: Path) -> None:
    parent = model(tmp_path / "base", np.random.default_rng(1))
    child = model(tmp_path / "reshaped", np.random.default_rng(1), wide=256)
    (child / "extra.safetensors").write_bytes((parent / "model-00002-of-00002.safetensors").read_bytes())
    report = sanity.evaluate(child, parent)
    metrics = report.metrics()
    assert metrics["shape_changes"] == 2  # embed and mlp lost half their rows
    assert metrics["files_added"] == 1 and report.files_added == ["extra.safetensors"]
    assert metrics["tensors_added"] == 1 and report.added == ["extra.safetensors:lm_head.weight"]
    big = model(tmp_path / "drifted", np.random.default_rng(2))  # another model altogether
    assert sanity.evaluate(big, parent).metrics()["max_rel_norm_change"] < 0.05  # same scale, random
    blown = model(tmp_path / "blown", np.random.default_rng(1), scale=3.0)
    report = sanity.evaluate(blown, parent)
    assert report.metrics()["max_rel_norm_change"] == pytest.approx(2.0, rel=0.01)
    assert report.metrics()["tensors_over_norm_threshold"] == 3


def test_a_file_that_is_not_safetensors_is_a_clear_failure(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(sanity.SanityError, match="not a readable safetensors file"):
        sanity.evaluate(tmp_path / "m")


def test_the_cli_shows_the_table_and_fails_on_a_nan(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from gpucloud.cli.main import app

    parent = model(tmp_path / "base", np.random.default_rng(1))
    clean = CliRunner().invoke(app, ["weights", "sanity", str(parent)])
    assert clean.exit_code == 0, clean.output
    assert "nan_inf_count" in clean.output and "3 tensors" in clean.output
    bad = model(tmp_path / "bad", np.random.default_rng(1), nan=True)
    refused = CliRunner().invoke(app, ["weights", "sanity", str(bad), "--parent", str(parent), "--output", "json"])
    assert refused.exit_code == 1
    assert json.loads(refused.output)["metrics"]["nan_inf_count"] == 1
