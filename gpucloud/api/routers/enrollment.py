"""A re-imaged node's enrollment (`services.agent_enrollment`): the config drive its BMC fetches,
and the one-time token its booted agent redeems for the node's new agent credential.

Both take only the node's one-time enrollment token, checked by the gate before anything else
(`api/gate.py`: the BMC sends it as basic auth, the agent as a bearer token); no other
credential opens them, and the token opens nothing else. They are matched after every other
route: a node enrolls once a re-image, while the agents' reports come first (`routers/agents.py`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from gpucloud.api.auth import Caller
from gpucloud.api.deps import DbDep, SettingsDep, get_any_caller
from gpucloud.models.tables import AgentEnrollment
from gpucloud.services import agent_enrollment
from gpucloud.services.agent_enrollment import CONFIG_DRIVE_PATH, ENROLL_PATH, EnrollmentRefused
from gpucloud.web.problems import Problem


async def _enrolling(request: Request, caller: Annotated[Caller, Depends(get_any_caller)]) -> tuple[str, str]:
    """(node id, token) of the enrollment the gate checked."""
    token = getattr(request.state, "enrollment_token", None)
    if caller.role != "enrollment" or caller.node_id is None or token is None:
        raise Problem(403, "forbidden", "Enrollment only", "this takes the node's one-time enrollment token")
    return caller.node_id, token


router = APIRouter(prefix="/v1")
EnrollingDep = Annotated[tuple[str, str], Depends(_enrolling)]


class ConfigDrive(BaseModel):
    node_id: str
    enrollment_token: str = Field(description="one-time: redeemed once at enroll_path for the node's credential")
    api_url: str
    enroll_path: str
    expires_at: str


class Enrolled(BaseModel):
    node_id: str
    credential: str = Field(description="the node's new agent credential (gpa_<node id>.<secret>), shown once")


def _refused(node_id: str, refused: EnrollmentRefused) -> Problem:
    return Problem(401, "unauthenticated", "Enrollment refused", f"node {node_id}: {refused}")


@router.get(CONFIG_DRIVE_PATH.removeprefix("/v1"), response_model=ConfigDrive, tags=["nodes"])
def config_drive(enrolling: EnrollingDep, db: DbDep, settings: SettingsDep) -> ConfigDrive:
    """The node's config drive, as its BMC fetches it for virtual media: what the booted image's
    agent needs to enroll (its node id, the one-time token, the API's URL)."""
    node_id, token = enrolling
    with db.reads() as session:
        row = session.get(AgentEnrollment, node_id)
        if row is None:
            raise _refused(node_id, EnrollmentRefused("no enrollment is handed out"))
        return ConfigDrive(**agent_enrollment.config_drive(row, token, api_url=settings.api_url))


@router.post(ENROLL_PATH.removeprefix("/v1"), response_model=Enrolled, tags=["nodes"])
def enroll(enrolling: EnrollingDep, request: Request, db: DbDep) -> Enrolled:
    """Redeem the node's one-time enrollment token for its new agent credential: once, and only
    before it expires."""
    node_id, token = enrolling
    try:
        with db.session() as session:
            credential = agent_enrollment.redeem(session, token)
    except EnrollmentRefused as refused:
        raise _refused(node_id, refused) from None
    # The one it replaced (revoked with the allocation) ends here at once.
    request.app.state.credentials.forget(f"gpa_{node_id}")
    return Enrolled(node_id=node_id, credential=credential)
