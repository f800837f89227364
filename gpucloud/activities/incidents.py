"""The incident workflow's activities: each one short transaction over the control-plane DB
(`services.incidents`). The workflow id is the incident's key, so a retried open finds the row
its first try made."""

from __future__ import annotations

from temporalio import activity
from temporalio.exceptions import ApplicationError

from gpucloud.activities import ActivityGroup
from gpucloud.db import Database
from gpucloud.models.incident_messages import IncidentClose, IncidentInput, IncidentProgress, IncidentRef
from gpucloud.services import incidents


def _progress(incident) -> IncidentProgress:
    return IncidentProgress(
        incident_id=incident.id,
        phase=incident.phase,
        status=incident.status,
        # The history shows its end (write-up next), or it was closed already (nothing to wait for).
        ended=incident.phase == "write_up" or incident.status != "open",
    )


class IncidentActivities(ActivityGroup):
    def __init__(self, db: Database) -> None:
        self.db = db

    @activity.defn
    def open_incident(self, req: IncidentInput) -> IncidentProgress:
        with self.db.session() as session:
            incident = incidents.open_incident(session, workflow_id=activity.info().workflow_id or req.node_id, inp=req)
            return _progress(incident)

    @activity.defn
    def observe_incident(self, req: IncidentRef) -> IncidentProgress:
        try:
            with self.db.session() as session:
                incident, _ = incidents.observe(session, req.incident_id)
                return _progress(incident)
        except incidents.IncidentNotFound as exc:
            raise ApplicationError(f"incident {exc} does not exist", type="IncidentNotFound", non_retryable=True)

    @activity.defn
    def close_incident(self, req: IncidentClose) -> IncidentProgress:
        try:
            with self.db.session() as session:
                incident = incidents.close(session, req.incident_id, abandoned=req.abandoned)
                return _progress(incident)
        except incidents.IncidentNotFound as exc:
            raise ApplicationError(f"incident {exc} does not exist", type="IncidentNotFound", non_retryable=True)
