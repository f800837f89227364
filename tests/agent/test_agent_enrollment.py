"""A re-imaged node's one-time enrollment token (`services/agent_enrollment.py`): the config drive
its BMC fetches and the booted agent's redemption take it and nothing else; it opens nothing
else; it is good once and only before it expires. The whole re-image, with the emulated BMC's
config drive and the simulated node redeeming it, is `test_bmc_lifecycle.py`'s."""

from __future__ import annotations

import base64
import json
from datetime import timedelta

import httpx
import pytest
from sqlmodel import col, select
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from gpucloud.activities.bmc import BmcActivities
from gpucloud.adapters.bmc import BmcError
from gpucloud.agent.app import Agent
from gpucloud.agent.host import HostState
from gpucloud.agent.reporting import Reporter
from gpucloud.db import Database, session_scope
from gpucloud.models.messages import EnrollmentInput
from gpucloud.models.tables import AgentEnrollment, Node, NodeTransition, utcnow
from gpucloud.services.agent_enrollment import EnrollmentTokens, redeem
from gpucloud.sim.probe import SimulatedProbe
from support.nodes import enroll

pytestmark = pytest.mark.integration


def _basic(user: str, password: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def _node_and_tokens(h) -> tuple[str, EnrollmentTokens]:
    node_id = h.enroll_fleet()[0]  # the node's row (no worker runs its bring-up here)
    return node_id, EnrollmentTokens(h.settings.agent_credential_secret, ttl_s=600)


def _hand_out(h, tokens: EnrollmentTokens, node_id: str, step: str) -> str:
    with session_scope(h.settings.database_url) as session:
        return tokens.hand_out(session, node_id, step).token


async def test_an_enrollment_token_fetches_the_drive_and_redeems_once(db_url, make_harness):
    h = make_harness(db_url, nodes=1)
    node_id, tokens = _node_and_tokens(h)
    token = _hand_out(h, tokens, node_id, "wf/run/1")
    assert token == _hand_out(h, tokens, node_id, "wf/run/1")  # a retried hand-out: the same one

    # The BMC fetches the drive with basic auth (user: the node id), as Redfish InsertMedia does.
    with h.client("") as bmc:
        drive = bmc.get("/v1/agents/config-drive", headers=_basic(node_id, token))
        assert drive.status_code == 200, drive.text
        assert drive.json()["enrollment_token"] == token and drive.json()["node_id"] == node_id
        assert drive.json()["api_url"] == h.settings.api_url and drive.json()["enroll_path"] == "/v1/agents/enroll"
        wrong_user = bmc.get("/v1/agents/config-drive", headers=_basic("other-node", token))
        assert wrong_user.status_code == 401

    with h.client(token) as agent:
        # It opens nothing but the enrollment: not the reports, not the tenant or operator API.
        for method, path in (("POST", "/v1/agents/heartbeats"), ("GET", "/v1/allocations"), ("GET", "/v1/nodes")):
            assert agent.request(method, path, json={}).status_code == 401, path
        first = agent.post("/v1/agents/enroll")
        assert first.status_code == 200, first.text
        credential = first.json()["credential"]
        assert credential.startswith(f"gpa_{node_id}.")
        again = agent.post("/v1/agents/enroll")
        assert again.status_code == 401 and "already redeemed" in again.json()["detail"], again.text
        # Redeemed, the drive is no longer served either.
        assert agent.get("/v1/agents/config-drive").status_code == 401
    with h.client(credential) as agent:  # the credential it redeemed reports for its node
        beat = {"node_id": node_id, "tenant_id": None, "workload_running": False, "boot_id": "b9"}
        assert agent.post("/v1/agents/heartbeats", json={"heartbeats": [beat]}).status_code == 200
        # An agent credential is no enrollment token.
        assert agent.post("/v1/agents/enroll").status_code == 401


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_an_expired_or_replaced_enrollment_token_is_refused(db_url, make_harness):
    h = make_harness(db_url, nodes=1)
    node_id, tokens = _node_and_tokens(h)
    old = _hand_out(h, tokens, node_id, "wf/run/1")
    new = _hand_out(h, tokens, node_id, "wf/run/2")  # the next re-image replaces it
    with h.client(old) as agent:
        refused = agent.post("/v1/agents/enroll")
        assert refused.status_code == 401 and "replaced" in refused.json()["detail"], refused.text
    with session_scope(h.settings.database_url) as session:
        row = session.get(AgentEnrollment, node_id)
        assert row is not None
        row.expires_at = utcnow() - timedelta(seconds=1)
        session.add(row)
    with h.client(new) as agent:
        refused = agent.post("/v1/agents/enroll")
        assert refused.status_code == 401 and "expired" in refused.json()["detail"], refused.text
    for bad in ("gpe_", f"gpe_{node_id}.", f"gpe_{node_id}.not-the-secret", "gpe_no-such-node.x"):
        with h.client(bad) as agent:
            assert agent.post("/v1/agents/enroll").status_code == 401, bad


class _Bmc:
    """A BMC's virtual media as `bmc_hand_enrollment` uses it: `second` False is a BMC with only
    the CD it boots from (no second device for a config drive)."""

    def __init__(self, *, second: bool = True) -> None:
        self.second, self.inserted, self.ejected = second, [], 0

    def for_node(self, url: str, system_id: str, credential_ref: str) -> _Bmc:
        return self

    def insert_config_media(self, url: str, *, username: str, password: str) -> str:
        if not self.second:
            raise BmcError("unsupported", "the BMC's virtual media has no second device")
        self.inserted.append((url, username, password))
        return "config drive inserted in Floppy"

    def eject_config_media(self) -> str:
        self.ejected += 1
        return "Floppy ejected"


def _bmc_node(db_url: str) -> str:
    enroll(db_url, ["n-1"])
    with session_scope(db_url) as session:
        node = session.get(Node, "n-1")
        assert node is not None
        node.bmc_url, node.bmc_system_id, node.bmc_credential_ref = "https://bmc.invalid", "sys-1", "ref"
        session.add(node)
    return "n-1"


def _kinds(db_url: str, node_id: str) -> list[tuple[str, str]]:
    with session_scope(db_url) as session:
        rows = session.exec(
            select(NodeTransition).where(col(NodeTransition.node_id) == node_id).order_by(col(NodeTransition.seq))
        ).all()
        return [(row.event, row.cause or "") for row in rows]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_booted_agent_that_never_enrolls_fails_closed_and_no_drive_falls_back_in_band(db_url):
    node_id = _bmc_node(db_url)
    tokens = EnrollmentTokens("secret", ttl_s=600)
    bmc = _Bmc()
    activities = BmcActivities(
        Database(db_url), bmc, boot_wait_s=0.5, enrollment=tokens, config_drive_url="http://api/v1/agents/config-drive"
    )  # type: ignore[arg-type]
    step = EnrollmentInput(node_id=node_id, request_id="wf/run/7")
    with pytest.raises(ApplicationError) as raised:
        ActivityEnvironment().run(activities.bmc_hand_enrollment, step)
    assert raised.value.type == "AgentDidNotEnroll" and raised.value.non_retryable
    # The drive carried this step's token, fetched as the node; it was ejected after the wait.
    assert bmc.inserted == [("http://api/v1/agents/config-drive", node_id, tokens.token(node_id, "wf/run/7"))]
    assert bmc.ejected == 1
    kinds = _kinds(db_url, node_id)
    assert [k for k, _ in kinds[-2:]] == ["enrollment_handed", "enrollment_timeout"], kinds

    # Redeemed in time (the booted agent enrolls while the activity waits): done.
    with session_scope(db_url) as session:
        redeem(session, tokens.token(node_id, "wf/run/7"))
    done = ActivityEnvironment().run(activities.bmc_hand_enrollment, step)
    assert done.done and "redeemed its one-time enrollment token" in done.answer
    assert _kinds(db_url, node_id)[-1][0] == "agent_enrolled"

    # A BMC with no second medium: not done, the wipe hands the credential in band, said so.
    activities.bmcs = _Bmc(second=False)  # type: ignore[assignment]
    fallback = ActivityEnvironment().run(
        activities.bmc_hand_enrollment, EnrollmentInput(node_id=node_id, request_id="wf/run/9")
    )
    assert not fallback.done
    event, cause = _kinds(db_url, node_id)[-1]
    assert event == "enrollment_inband" and "weaker" in cause


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_the_real_agent_redeems_its_config_drive_once_and_reports_with_the_credential(
    db_url, make_harness, tmp_path
):
    h = make_harness(db_url, nodes=1)
    node_id, tokens = _node_and_tokens(h)
    token = _hand_out(h, tokens, node_id, "wf/run/3")
    with h.client("") as bmc:  # the document as the BMC fetched it, placed by the clean image
        drive = bmc.get("/v1/agents/config-drive", headers=_basic(node_id, token)).json()
    (tmp_path / "drive.json").write_text(json.dumps(drive))
    state = HostState(
        node_id=node_id, boot_id="fresh-boot", scratch_dir=tmp_path / "s", credential_file=tmp_path / "credential"
    )
    agent = Agent(state, SimulatedProbe(node_id))
    async with httpx.AsyncClient(base_url=h.settings.api_url) as client:
        reporter = Reporter(agent, client, enrollment_file=tmp_path / "drive.json")
        assert reporter.enroller is not None
        assert await reporter.enroller.once()  # redeemed
        assert state.credential is not None and state.credential.startswith(f"gpa_{node_id}.")
        assert (tmp_path / "credential").read_text().strip() == state.credential  # kept for restarts
        before = h.node(node_id)["last_heartbeat_at"]
        await reporter.heartbeat_once()
        assert h.node(node_id)["last_heartbeat_at"] != before  # it reports with the new credential
        assert not await reporter.enroller.once()  # the same drive is not sent again
    with h.client(token) as spent:
        assert spent.post("/v1/agents/enroll").status_code == 401
    # A drive for another node is never redeemed.
    (tmp_path / "other.json").write_text(json.dumps(drive | {"node_id": "another-node"}))
    async with httpx.AsyncClient(base_url=h.settings.api_url) as client:
        other = Reporter(
            Agent(HostState(node_id="n-x", boot_id="b", scratch_dir=tmp_path / "x"), SimulatedProbe("n-x")),
            client,
            enrollment_file=tmp_path / "other.json",
        )
        assert other.enroller is not None and not await other.enroller.once()
