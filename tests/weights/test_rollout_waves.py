"""`plan_waves` and the rollout input's validation: pure, no server."""

import functools
import operator

import pytest
from pydantic import ValidationError

from gpucloud.models.rollout_messages import DEFAULT_WAVES, RolloutInput, RolloutTarget, WaveSpec, plan_waves

pytestmark = pytest.mark.unit

NODES = [f"n{i}" for i in range(20)]


def test_default_waves_are_canary_then_10_50_100_percent() -> None:
    assert [len(w) for w in plan_waves(NODES, DEFAULT_WAVES)] == [1, 1, 8, 10]
    assert functools.reduce(operator.iadd, plan_waves(NODES, DEFAULT_WAVES), []) == NODES


def test_waves_that_add_nobody_are_dropped_and_the_last_reaches_everyone() -> None:
    assert plan_waves(NODES[:3], DEFAULT_WAVES) == [["n0"], ["n1"], ["n2"]]
    assert plan_waves(NODES[:5], [WaveSpec(nodes=2)]) == [NODES[:2], NODES[2:5]]


def test_the_input_names_exactly_one_target() -> None:
    digest = "a" * 64
    node = RolloutTarget(node_id="n0", agent_url="http://x")
    with pytest.raises(ValidationError, match="name the target once"):
        RolloutInput(rollout_id="r", tenant_id="t", model_version=digest)
    with pytest.raises(ValidationError, match="name the target once"):
        RolloutInput(rollout_id="r", tenant_id="t", model_version=digest, nodes=[node], serving_fleet=True)
    with pytest.raises(ValidationError, match="twice"):
        RolloutInput(rollout_id="r", tenant_id="t", model_version=digest, nodes=[node, node])
    with pytest.raises(ValidationError, match="either nodes or fraction"):
        WaveSpec(nodes=1, fraction=0.5)
