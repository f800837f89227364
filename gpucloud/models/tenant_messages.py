"""Inputs and results of the tenant workflows and their activities: one pydantic model each.

Workflow code imports these, so this module imports nothing heavier than pydantic.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

# What a tenant id may hold, wherever one names a path, a folder or a prefix (the ledger's paths,
# a node's weight folders, the storage and registry prefixes): an id's characters only.
TENANT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"


class TenantRef(BaseModel):
    """A message about one tenant."""

    tenant_id: str


class TenantView(TenantRef):
    name: str
    status: str
    vni: int | None = None
    storage_prefix: str | None = None


class TenantOnboardingInput(TenantRef):
    operation_id: str
    # How long the steps may wait out outages before onboarding gives up and is undone.
    deadline_s: float = 6 * 3600.0


class TenantOnboardingResult(TenantRef):
    status: str
    vni: int | None = None
    storage_prefix: str | None = None
    # Why onboarding failed (every step was undone), when it did.
    error: str | None = None


class TenantVni(TenantRef):
    # None once released.
    vni: int | None = None
    # "sdn" (the SDN controller's VPC) or "db" (no fabric managers configured).
    source: str = "db"


class TenantStorageResult(TenantRef):
    prefix: str
    data_key_version: int


class SettleTenantInput(TenantRef):
    """Finish a tenant step that settles its operation: success, or failure with `error`."""

    operation_id: str
    error: str | None = None


class ActivateTenantInput(TenantRef):
    operation_id: str
    storage_prefix: str


class TenantOffboardingInput(TenantRef):
    operation_id: str
    # How often to look whether the tenant's nodes are released and wiped.
    poll_s: float = 5.0
    # The tenant's storage is deleted this long after offboarding.
    retention_s: float = 30 * 86_400.0


class AllocationCancel(BaseModel):
    """An allocation whose cancel intent offboarding recorded, and the operation that tracks it."""

    allocation_id: str
    operation_id: str | None = None


class CancelledAllocations(BaseModel):
    cancels: list[AllocationCancel] = Field(default_factory=list)

    @property
    def allocation_ids(self) -> list[str]:
        return [c.allocation_id for c in self.cancels]


class TenantReleaseProgress(BaseModel):
    open_allocations: int
    # Nodes that may still hold the tenant's data and are on their way to a wipe.
    nodes_in_flight: int
    # Nodes that still hold the tenant's data but sit in quarantine, repair or RMA: they are
    # wiped by their repair before anyone else gets them.
    nodes_parked: int

    @property
    def done(self) -> bool:
        return self.open_allocations == 0 and self.nodes_in_flight == 0


class RevokedKeys(BaseModel):
    revoked: int


class StorageDeletionInput(TenantRef):
    retention_s: float


class StorageDeletion(TenantRef):
    due_at: datetime | None = None
    objects_deleted: int = 0


class TenantBilling(TenantRef):
    # Why nothing was looked up (no ledger configured, or the ledger refused).
    skipped: str | None = None
    # The open period that carries the tenant's final usage; its scheduled close issues the
    # final invoice.
    final_period_id: str | None = None
    usage_gpu_ms: int | None = None


class TenantOffboardingResult(TenantRef):
    status: str
    cancelled_allocations: list[str] = Field(default_factory=list)
    nodes_awaiting_repair: int = 0
    keys_revoked: int = 0
    storage_deletion_due: datetime | None = None
    storage_deleted: bool = False
    billing: TenantBilling | None = None
