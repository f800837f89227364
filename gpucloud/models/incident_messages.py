"""What the incident workflow (`workflows/incident.py`) and its activities
(`activities/incidents.py`) hand each other. Pydantic only: the workflow sandbox loads this."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class IncidentInput(BaseModel):
    """Open (or find) the incident of a pull and follow it to its end; or follow a fleet-kind
    incident (a correlated burst, a breaker trip) whose row its cause wrote (`incident_id` and
    `workflow_id` given; `node_id` its first node)."""

    node_id: str
    kind: str = "node"
    # A fleet-kind incident's workflow id (`workflow_ids.fleet_incident_workflow_id`,
    # `breaker_incident_workflow_id`); None: a pull's, from the node and the fault's moment.
    workflow_id: str | None = Field(None, max_length=300)
    # The first fault, as the node reported it (or the pulling condition's `since`).
    detected_at: datetime
    # The moment the workflow id names: the pulling condition's `since`, which the API's pull and
    # the reconciler's re-sent one both read (None: `detected_at`).
    key_at: datetime | None = None
    reason: str = Field("", max_length=1000)
    allocation_id: str | None = None
    # How often the node's history is read again, and how long the incident waits for the node
    # to come back (or go to RMA) before it closes as abandoned.
    poll_s: float = Field(30.0, gt=0)
    max_wait_s: float = Field(7 * 86_400.0, gt=0)
    # Looks per run before the wait goes on in a new run (continue-as-new: a short history).
    looks_per_run: int = Field(500, ge=1, le=2000)
    # Carried through continue-as-new: the incident already opened, when the workflow began.
    incident_id: str | None = None
    started_at: datetime | None = None


class IncidentRef(BaseModel):
    incident_id: str


class IncidentProgress(BaseModel):
    """The incident as the last look at the node's history left it."""

    incident_id: str
    phase: str
    status: str
    ended: bool = False


class IncidentClose(BaseModel):
    """Close the incident (`abandoned`: the workflow stopped waiting) and write its write-up."""

    incident_id: str
    abandoned: bool = False
