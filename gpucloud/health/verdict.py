"""The vocabulary of a health decision: health, actions, conditions, and the policy's knobs.

A node's health (`ok | suspect | failed`) is separate from its provision state; the health rules
(`health/rules.py`) produce a `HealthVerdict` and the workflows act on its `action`. Both enums
are ordered by severity so that combining conditions is "take the worst".
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from enum import StrEnum

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field


class Health(StrEnum):
    OK = "ok"
    SUSPECT = "suspect"
    FAILED = "failed"


class Action(StrEnum):
    """What the control plane should do about a node, mildest first.

    `rma` ranks above `drain_now`: it implies pulling the node at once *and* skipping the
    reset → reboot → reflash ladder, because that ladder has already failed or cannot help.
    """

    NONE = "none"
    WATCH = "watch"
    DRAIN = "drain"
    DRAIN_NOW = "drain_now"
    RMA = "rma"


_HEALTH_ORDER = list(Health)
_ACTION_ORDER = list(Action)


def worst_health(values: Iterable[Health]) -> Health:
    return max(values, key=_HEALTH_ORDER.index, default=Health.OK)


def worst_action(values: Iterable[Action]) -> Action:
    return max(values, key=_ACTION_ORDER.index, default=Action.NONE)


def action_rank(action: Action) -> int:
    return _ACTION_ORDER.index(action)


class Condition(BaseModel):
    """One reason for a node's health, stored on the node (`Node.health_conditions`).

    `name` is stable and machine-readable (`xid_79`, `lemon`, `ecc_corrected_rate`, ...);
    `reason` is the sentence an operator reads.
    """

    model_config = ConfigDict(frozen=True)

    name: str
    reason: str
    since: AwareDatetime
    health: Health
    action: Action
    gpu_index: int | None = None
    xid: int | None = None


class HealthVerdict(BaseModel):
    model_config = ConfigDict(frozen=True)

    health: Health
    action: Action
    conditions: tuple[Condition, ...] = ()

    @classmethod
    def of(cls, conditions: Iterable[Condition]) -> HealthVerdict:
        ordered = sorted(conditions, key=lambda c: (-action_rank(c.action), c.since, c.name))
        return cls(
            health=worst_health(c.health for c in ordered),
            action=worst_action(c.action for c in ordered),
            conditions=tuple(ordered),
        )


class HealthPolicy(BaseModel):
    """The thresholds of the health rules. Defaults are starting points, tuned per fleet.

    Counter rates are per GPU per hour, measured over `trend_window`; a span shorter than an
    hour counts as an hour so that two readings a minute apart cannot fake a high rate.
    """

    model_config = ConfigDict(frozen=True)

    burst_window: timedelta = Field(default=timedelta(minutes=5), gt=timedelta(0))
    lemon_window: timedelta = timedelta(days=30)
    lemon_fatal_episodes: int = Field(default=2, ge=1)
    application_window: timedelta = timedelta(days=7)
    application_escalation_tenants: int = Field(default=2, ge=2)
    application_escalation_incidents: int = Field(default=3, ge=1)
    trend_window: timedelta = timedelta(hours=24)
    ecc_corrected_per_hour: float = 100.0
    nvlink_errors_per_hour: float = 100.0
    nvlink_recoveries_per_hour: float = 0.5
    # DCGM's health watch flags more than 8 PCIe replays a minute; the same bar, per hour.
    pcie_replays_per_hour: float = 480.0
    hardware_slowdown_readings: int = Field(default=3, ge=1)


DEFAULT_POLICY = HealthPolicy()
