"""A seam for fault injection: activities that take a `FaultHook` call it just before their
effect and just after it (the effect done, its report not yet sent), so a test can fail a step
either way and check that what follows (a retry, or undoing the steps before) is right."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class FaultPoint:
    step: str  # the activity's name
    phase: str  # "before" or "after" its effect
    tenant_id: str


FaultHook = Callable[[FaultPoint], None]


def reach(hook: FaultHook | None, step: str, phase: str, tenant_id: str) -> None:
    if hook is not None:
        hook(FaultPoint(step=step, phase=phase, tenant_id=tenant_id))
