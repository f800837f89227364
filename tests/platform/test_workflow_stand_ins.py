"""The stand-ins (`support/workflow_mocks.py`) stay the real activities' doubles: each is registered under a real
activity's name and takes and returns the same types, so a renamed activity or a changed input
model fails here, by name, rather than as a workflow test that waits for a worker that never
answers."""

from __future__ import annotations

import inspect
from typing import Any, get_type_hints

import pytest

from gpucloud.activities.bmc import BmcActivities
from gpucloud.activities.control_db import ControlDbActivities
from gpucloud.activities.fabric import FabricActivities
from gpucloud.activities.host_agent import HostAgentActivities
from gpucloud.activities.ledger import LedgerActivities
from gpucloud.activities.reconciler import ReconcilerActivities
from support.workflow_mocks import StandIns

pytestmark = pytest.mark.workflow

REAL = (
    BmcActivities,
    ControlDbActivities,
    FabricActivities,
    HostAgentActivities,
    LedgerActivities,
    ReconcilerActivities,
)


def _name(fn: Any) -> str:
    return getattr(fn, "__temporal_activity_definition").name


def _signature(fn: Any) -> tuple[list[Any], Any]:
    hints = get_type_hints(fn)
    params = [hints.get(p) for p in list(inspect.signature(fn).parameters)[1:]]  # after self
    return params, hints.get("return")


def _real() -> dict[str, Any]:
    found = {}
    for klass in REAL:
        for value in vars(klass).values():
            if callable(value) and hasattr(value, "__temporal_activity_definition"):
                found[_name(value)] = value
    return found


def test_every_stand_in_is_a_real_activity_with_its_types() -> None:
    real = _real()
    for stand_in in StandIns().activities():
        name = _name(stand_in)
        assert name in real, f"stand-in {name} answers for no real activity: renamed? ({sorted(real)})"
        assert _signature(stand_in.__func__) == _signature(real[name]), f"{name} takes or returns other types"
