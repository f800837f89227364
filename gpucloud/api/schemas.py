"""The API's wire schemas moved to `gpucloud.models.api_schemas` (a contract on the bottom floor);
what the routers still importing them from here need (health, rollouts), re-exported until they
import it from there."""

from gpucloud.models.api_schemas import (
    MAX_READING_CLOCK_SKEW,
    AlertPage,
    HealthDecision,
    NodeHealth,
    ReadingIngestResult,
    RolloutAccepted,
    RolloutCommand,
    RolloutPage,
    RolloutRequest,
    RolloutSummary,
    XidIngestResult,
    XidInjection,
    XidRecordPublic,
)

__all__ = [
    "MAX_READING_CLOCK_SKEW",
    "AlertPage",
    "HealthDecision",
    "NodeHealth",
    "ReadingIngestResult",
    "RolloutAccepted",
    "RolloutCommand",
    "RolloutPage",
    "RolloutRequest",
    "RolloutSummary",
    "XidIngestResult",
    "XidInjection",
    "XidRecordPublic",
]
