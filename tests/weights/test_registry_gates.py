"""Pure registry logic without a server: evaluation gates, lineage walks, store configuration, and the
0002 migration against the registry tables."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from gpucloud.bootstrap import registry_stores
from gpucloud.config import ObjectStoreSettings, Settings
from gpucloud.models.registry_names import AliasName
from gpucloud.models.registry_tables import GateSpec, RegistryModelCreate
from gpucloud.registry.promotion import (
    VersionResults,
    evaluate_gates,
    platform_failures,
    walk_ancestors,
    walk_descendants,
)

pytestmark = pytest.mark.unit

ACCURACY = GateSpec(metric="accuracy", min=0.7, max_regression=0.02)
LATENCY = GateSpec(metric="latency_ms", max=100, max_regression=10, higher_is_better=False)


def command(results: dict[str, float] | None) -> dict[str, dict[str, float]] | None:
    """Results as the command evaluator's (the evaluator ACCURACY and LATENCY name)."""
    return None if results is None else {"command": results}


def failing(
    candidate: dict[str, float], production: dict[str, float] | None = None, gates: list[GateSpec] = (ACCURACY, LATENCY)
) -> list[tuple[str, str]]:
    return [(f.metric, f.reason.split()[0]) for f in evaluate_gates(gates, command(candidate), command(production))]


def test_a_gate_names_its_evaluator_and_takes_no_other_evaluators_value() -> None:
    assert ACCURACY.evaluator == "command"  # not one of the sanity evaluator's metrics
    nan_gate = GateSpec(metric="nan_inf_count", max=0)
    assert nan_gate.evaluator == "sanity"
    # The command printed a nan_inf_count of 0, but the gate holds the sanity evaluator's.
    failures = evaluate_gates([nan_gate], {"command": {"nan_inf_count": 0}, "sanity": {"nan_inf_count": 1}}, None)
    assert [(f.metric, f.evaluator, f.value) for f in failures] == [("nan_inf_count", "sanity", 1.0)]
    assert failures[0].describe() == "nan_inf_count (sanity)=1: above the maximum 0"
    missing = evaluate_gates([nan_gate], {"command": {"nan_inf_count": 0}}, None)
    assert missing[0].reason == "no result from a platform sanity evaluation"
    named = GateSpec(metric="nan_inf_count", max=0, evaluator="command")
    assert evaluate_gates([named], {"command": {"nan_inf_count": 0}}, None) == []


def test_a_failed_latest_run_fails_the_gates_of_its_evaluator() -> None:
    failures = evaluate_gates(
        [ACCURACY], {"command": {"accuracy": 0.9}}, None, errors={"command": "ran past its time limit of 5 s"}
    )
    assert [(f.metric, f.value) for f in failures] == [("accuracy", None)]
    assert failures[0].reason == "the latest command evaluation failed: ran past its time limit of 5 s"


def _platform(alias: AliasName, candidate: VersionResults, **options) -> list[tuple[str | None, str, str]]:
    return [(f.metric, f.evaluator, f.reason) for f in platform_failures(alias, candidate, **options)]


def test_the_platform_fails_closed_whatever_the_models_gates() -> None:
    """Issue 37: a model without gates took a version whose sanity evaluation found a NaN to production."""
    unevaluated = VersionResults()
    assert _platform(AliasName.CANDIDATE, unevaluated) == []
    assert _platform(AliasName.STAGING, unevaluated) == []
    [(metric, evaluator, reason)] = _platform(AliasName.PRODUCTION, unevaluated)
    assert (metric, evaluator) == ("nan_inf_count", "sanity") and "none has run" in reason
    assert _platform(AliasName.PRODUCTION, unevaluated, require_sanity=False) == []  # the operator's choice

    nan = VersionResults(platform={"sanity": {"nan_inf_count": 1}})
    for alias in (AliasName.STAGING, AliasName.PRODUCTION):
        for require_sanity in (True, False):
            assert _platform(alias, nan, require_sanity=require_sanity) == [
                ("nan_inf_count", "sanity", "above the maximum 0")
            ]
    assert _platform(AliasName.CANDIDATE, nan) == []

    crashed = VersionResults(platform={"sanity": {"nan_inf_count": 0}}, errors={"command": "exit status 1"})
    for alias in (AliasName.STAGING, AliasName.PRODUCTION):
        failures = platform_failures(alias, crashed, require_sanity=False)
        assert [(f.metric, f.evaluator) for f in failures] == [(None, "command")]
        assert failures[0].describe() == "command evaluation: the latest command evaluation failed: exit status 1"
    failed_sanity = VersionResults(errors={"sanity": "not a safetensors file"})
    assert _platform(AliasName.STAGING, failed_sanity) == [
        ("nan_inf_count", "sanity", "the latest sanity evaluation failed: not a safetensors file")
    ]
    assert _platform(AliasName.PRODUCTION, VersionResults(platform={"sanity": {"nan_inf_count": 0}})) == []


def test_the_platform_does_not_repeat_what_the_models_gates_said() -> None:
    nan = VersionResults(platform={"sanity": {"nan_inf_count": 2}})
    gated = evaluate_gates([GateSpec(metric="nan_inf_count", max=0)], nan.platform, None)
    assert platform_failures(AliasName.PRODUCTION, nan, gated=gated) == []
    crashed = VersionResults(platform={"sanity": {"nan_inf_count": 0}}, errors={"command": "hung"})
    gated = evaluate_gates([ACCURACY], crashed.platform, None, errors=crashed.errors)
    assert [f.metric for f in gated] == ["accuracy"]
    assert platform_failures(AliasName.STAGING, crashed, gated=gated) == []


def test_passing_results_fail_nothing() -> None:
    assert failing({"accuracy": 0.9, "latency_ms": 50}, {"accuracy": 0.9, "latency_ms": 50}) == []
    assert failing({"accuracy": 0.9}, gates=[]) == []  # no gates: nothing to pass


def test_bounds_are_inclusive() -> None:
    assert failing({"accuracy": 0.7, "latency_ms": 100}) == []
    assert failing({"accuracy": 0.88, "latency_ms": 60}, {"accuracy": 0.90, "latency_ms": 50}) == []


def test_a_missing_result_fails_its_gate() -> None:
    assert failing({"latency_ms": 10}) == [("accuracy", "no")]
    assert evaluate_gates([ACCURACY], {}, None)[0].value is None


def test_every_failing_metric_is_reported_at_once() -> None:
    assert failing({"accuracy": 0.5, "latency_ms": 150}) == [("accuracy", "below"), ("latency_ms", "above")]


def test_regression_is_measured_in_the_direction_that_makes_the_metric_worse() -> None:
    production = {"accuracy": 0.90, "latency_ms": 50}
    assert failing({"accuracy": 0.87, "latency_ms": 50}, production) == [("accuracy", "regresses")]
    assert failing({"accuracy": 0.90, "latency_ms": 61}, production) == [("latency_ms", "regresses")]
    # Improvements are never regressions, however large.
    assert failing({"accuracy": 0.99, "latency_ms": 5}, production) == []
    failure = evaluate_gates([ACCURACY], command({"accuracy": 0.87}), command(production))[0]
    assert failure.production_value == 0.90 and math.isclose(float(failure.reason.split()[1]), 0.03)
    assert failure.describe().startswith("accuracy (command)=0.87: regresses")


def test_without_a_production_baseline_only_the_range_applies() -> None:
    assert failing({"accuracy": 0.71, "latency_ms": 99}, None) == []
    assert failing({"accuracy": 0.71, "latency_ms": 99}, {"other": 1.0}) == []


@pytest.mark.parametrize(
    "gate",
    [
        {"metric": "a"},
        {"metric": "a", "min": 2, "max": 1},
        {"metric": "a", "max_regression": -0.1},
        {"metric": "a", "min": math.inf},
        {"metric": "", "min": 1},
        {"metric": "a", "min": 1, "extra": 2},
        {"metric": "a", "min": 1, "evaluator": "mmlu-job"},
    ],
)
def test_meaningless_gates_are_refused(gate: dict) -> None:
    with pytest.raises(ValidationError):
        GateSpec(**gate)


def test_a_model_has_one_gate_per_metric() -> None:
    with pytest.raises(ValidationError, match="one gate"):
        RegistryModelCreate(name="m", gates=[{"metric": "a", "min": 1}, {"metric": "a", "max": 2}])


def test_ancestors_walk_to_the_root_and_stop_on_cycles_and_limits() -> None:
    parents = {"d": "c", "c": "b", "b": "a", "a": None}
    assert walk_ancestors("d", parents.get) == ["c", "b", "a"]
    assert walk_ancestors("a", parents.get) == []
    assert walk_ancestors("x", {"x": "unknown"}.get) == ["unknown"]  # a parent of another tenant is never asked
    assert walk_ancestors("a", {"a": "b", "b": "c", "c": "a"}.get) == ["b", "c"]
    assert walk_ancestors("d", parents.get, limit=2) == ["c", "b"]


def test_descendants_walk_breadth_first_each_once() -> None:
    children = {"a": ["b", "c"], "b": ["d"], "c": ["e", "f"], "e": ["a"]}

    def children_of(parents: list[str]) -> dict[str, list[str]]:
        return {p: children[p] for p in parents if p in children}

    assert walk_descendants("a", children_of) == [("b", 1), ("c", 1), ("d", 2), ("e", 2), ("f", 2)]
    assert walk_descendants("c", children_of) == [("e", 1), ("f", 1), ("a", 2), ("b", 3), ("d", 4)]
    assert walk_descendants("a", children_of, limit=1) == [("b", 1), ("c", 1)]
    assert walk_descendants("f", children_of) == []


def test_store_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="GPUCLOUD_OBJECT_STORE__BUCKET"):
        ObjectStoreSettings(backend="s3")
    monkeypatch.setenv("GPUCLOUD_OBJECT_STORE__BACKEND", "s3")
    monkeypatch.setenv("GPUCLOUD_OBJECT_STORE__BUCKET", "weights")
    assert Settings().object_store.bucket == "weights"
    monkeypatch.delenv("GPUCLOUD_OBJECT_STORE__BACKEND")

    stores = registry_stores(Settings(data_dir=tmp_path))
    assert stores.objects.root == (tmp_path / "objects").resolve()
    assert stores.chunks("ten_a").key("a" * 64) == f"registry/tenants/ten_a/chunks/aa/aa/{'a' * 64}"
    assert stores.chunks("ten_a") is stores.chunks("ten_a")
    assert stores.manifest_uri("ten_a", "f" * 64).endswith(f"/registry/tenants/ten_a/manifests/{'f' * 64}.json")
    with pytest.raises(ValueError, match="tenant id"):
        stores.chunks("../ten_b")


def test_registry_migration_matches_the_tables_and_downgrades(tmp_path: Path) -> None:
    import sqlalchemy as sa
    from alembic import command
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlmodel import SQLModel

    import gpucloud.models.registry_tables
    import gpucloud.models.tables  # noqa: F401
    from gpucloud.db import alembic_config, get_engine, migrate

    url = f"sqlite:///{tmp_path / 'r.db'}"
    migrate(url)
    with get_engine(url).connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), SQLModel.metadata)
    registry_diff = [d for d in diff if "registry_" in repr(d)]
    assert registry_diff == []
    command.downgrade(alembic_config(url), "0001")
    with get_engine(url).connect() as conn:
        assert not [t for t in sa.inspect(conn).get_table_names() if t.startswith("registry_")]
