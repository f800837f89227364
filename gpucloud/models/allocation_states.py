"""An allocation's status, as the API shows it and the allocation workflow moves it. Nothing but
the standard library: workflow code imports it (a str-valued enum travels in a payload as the
plain string it always was)."""

from __future__ import annotations

from enum import StrEnum


class AllocationStatus(StrEnum):
    # Waiting in its pool's queue for a fabric domain with room (`services/scheduling.py`).
    QUEUED = "queued"
    PROVISIONING = "provisioning"
    READY = "ready"
    # A node was pulled for a health fault; a replacement is on its way (the reason says which).
    DEGRADED = "degraded"
    CANCELLING = "cancelling"
    RELEASED = "released"
    FAILED = "failed"


TERMINAL_ALLOCATION = frozenset({AllocationStatus.RELEASED, AllocationStatus.FAILED})
