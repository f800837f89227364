"""One-time enrollment tokens: how a re-imaged node's booted image gets its agent credential.

The departing tenant had root on the node, so nothing that ran there before the re-image may
learn the next credential: not the agent that answered before the power cycle, and not a wipe
request that a replaced agent would answer. After the BMC booted the known image and the booted
agent reported the image's digest and a new boot id (`activities/bmc.py`), the control plane
hands out a one-time enrollment token through the image's configuration: a config drive, a
second virtual medium the BMC fetches from the API (`GET /v1/agents/config-drive`, with the
node id and the token as the download's basic credentials, as Redfish InsertMedia carries
them). The image's agent reads the drive and redeems the token (`POST /v1/agents/enroll`,
`Authorization: Bearer gpe_<node id>.<secret>`) for the node's new agent credential, once; the
control plane waits for that redemption before the node goes on to its wipe and burn-in.

The token is derived from the re-image step's request id under the control plane's agent
credential secret (as `WipeRotation` derives a wipe's credential), so a retried hand-out inserts
the same drive and a workflow's history never holds it; only its hash is stored. It is refused
once redeemed, past `expires_at`, and after another hand-out for the node replaced it. A
redemption whose answer was lost leaves the agent without a credential: the control plane's
wait times out, the node fails closed into quarantine, and its repair re-images it again with a
fresh token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlmodel import Session, col

from gpucloud.models.tables import AgentEnrollment, Node, utcnow
from gpucloud.protocol.reporter import ENROLL_PATH
from gpucloud.services import agent_credentials
from gpucloud.services.api_keys import hash_secret

PREFIX = "gpe_"
# Where the BMC fetches a node's config drive (the booted agent redeems it at `ENROLL_PATH`).
CONFIG_DRIVE_PATH = "/v1/agents/config-drive"
__all__ = ["CONFIG_DRIVE_PATH", "ENROLL_PATH", "EnrollmentRefused", "EnrollmentTokens"]


class EnrollmentRefused(Exception):
    """The token is not (or no longer) one the node may redeem; the message says why."""


@dataclass(frozen=True)
class HandedOut:
    token: str
    expires_at: datetime


def parse(token: str) -> tuple[str, str] | None:
    """(node id, secret) of an enrollment token's shape, else None (a node id may hold dots)."""
    if not token.startswith(PREFIX) or "." not in token:
        return None
    node_id, _, secret = token[len(PREFIX) :].rpartition(".")
    return (node_id, secret) if node_id and secret else None


class EnrollmentTokens:
    def __init__(self, secret: str, *, ttl_s: float) -> None:
        self._key = hashlib.sha256(b"gpucloud agent enrollment\0" + secret.encode()).digest()
        self.ttl_s = ttl_s

    def token(self, node_id: str, request_id: str) -> str:
        mac = hmac.new(self._key, f"{node_id}\0{request_id}".encode(), hashlib.sha256).digest()
        return f"{PREFIX}{node_id}.{base64.urlsafe_b64encode(mac).decode().rstrip('=')}"

    def hand_out(self, session: Session, node_id: str, request_id: str) -> HandedOut:
        """The node's enrollment token for this re-image step, stored (its hash) in place of any
        earlier one. A retry of the same step keeps the stored one, redeemed or not."""
        token = self.token(node_id, request_id)
        row = session.get(AgentEnrollment, node_id)
        if row is not None and row.request_id == request_id:
            return HandedOut(token, row.expires_at)
        now = utcnow()
        row = row or AgentEnrollment(node_id=node_id, secret_hash="", request_id="", expires_at=now)
        row.secret_hash, row.request_id = hash_secret(token.rsplit(".", 1)[1]), request_id
        row.issued_at, row.expires_at, row.redeemed_at = now, now + timedelta(seconds=self.ttl_s), None
        session.add(row)
        return HandedOut(token, row.expires_at)

    @staticmethod
    def redeemed(session: Session, node_id: str, request_id: str) -> datetime | None:
        """When this step's token was redeemed (None: not yet)."""
        row = session.get(AgentEnrollment, node_id)
        return row.redeemed_at if row is not None and row.request_id == request_id else None


def check(session: Session, token: str, *, now: datetime | None = None) -> AgentEnrollment:
    """The unredeemed, unexpired enrollment `token` is, else `EnrollmentRefused` saying why."""
    parsed = parse(token)
    row = session.get(AgentEnrollment, parsed[0]) if parsed else None
    if parsed is None or row is None or not hmac.compare_digest(row.secret_hash, hash_secret(parsed[1])):
        raise EnrollmentRefused("the enrollment token is unknown, or another re-image replaced it")
    if row.redeemed_at is not None:
        raise EnrollmentRefused(f"the enrollment token was already redeemed at {row.redeemed_at.isoformat()}")
    if row.expires_at <= (now or utcnow()):
        raise EnrollmentRefused(f"the enrollment token expired at {row.expires_at.isoformat()}")
    return row


def redeem(session: Session, token: str) -> str:
    """The node's new agent credential for `token`, once: the redemption is a compare-and-swap
    on `redeemed_at IS NULL`, so two agents presenting one token get one credential between them."""
    now = utcnow()
    row = check(session, token, now=now)
    taken = session.execute(
        sa.update(AgentEnrollment)
        .where(
            col(AgentEnrollment.node_id) == row.node_id,
            col(AgentEnrollment.secret_hash) == row.secret_hash,
            col(AgentEnrollment.redeemed_at).is_(None),
        )
        .values(redeemed_at=now)
        .execution_options(synchronize_session=False)
    )
    if taken.rowcount != 1:  # type: ignore[attr-defined]
        raise EnrollmentRefused("the enrollment token was already redeemed")
    if session.get(Node, row.node_id) is None:
        raise EnrollmentRefused(f"node {row.node_id} no longer exists")
    return agent_credentials.issue(session, row.node_id)


def config_drive(row: AgentEnrollment, token: str, *, api_url: str) -> dict:
    """What the config drive holds: everything the booted image's agent needs to enroll."""
    return {
        "node_id": row.node_id,
        "enrollment_token": token,
        "api_url": api_url,
        "enroll_path": ENROLL_PATH,
        "expires_at": row.expires_at.isoformat(),
    }
