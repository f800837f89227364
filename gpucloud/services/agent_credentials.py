"""Host-agent credentials: one per node, issued by an operator, shown once.

The agent on a node presents `gpa_<node id>.<secret>`; the API lets it report heartbeats, XID
events and readings for that node only (`api.deps.ReporterDep`). Tenants have root on the nodes
they rent, so what the agent holds must not be worth more than the node itself: never the
operator token. Issuing a credential again replaces the old one (rotation, or a re-imaged node).

Every wipe replaces it too (`WipeRotation`): the tenant who had root on the node held the old
one, so it must die before the node goes to anyone else. The wipe request carries the node's
next credential to the agent, which takes it up once the wipe succeeded; then the control plane
stores its hash and the old one answers 401 everywhere. The next credential is derived from the
wipe's request id under a control-plane secret, so a retried wipe carries the same one and never
appears in a workflow's history.

A wipe comes too late on its own: the drain path (a node pulled mid-allocation) reaches
quarantine, repair and RMA without one. So the credential is revoked (`revoke`) the moment a
tenant's allocation lets go of the node, in the very transaction that moves the node out of its
tenant's hands (`services.nodes.transition`): every path (release, drain, cancel, a failed
provision, replacement, offboarding) goes through it. Until the next wipe hands the agent a new
one, the node cannot report (heartbeats, readings and ledger tokens get 401), and the reconciler
reads its silence as expected, not as a host that went down.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Iterable
from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Session, col, select

from gpucloud.db import Database
from gpucloud.models.tables import AgentCredential, Node, utcnow
from gpucloud.services.api_keys import hash_secret


class UnknownNode(LookupError):
    pass


def issue(session: Session, node_id: str) -> str:
    """A new credential for the node's agent (the old one stops working); the token, once."""
    if session.get(Node, node_id) is None:
        raise UnknownNode(node_id)
    secret = secrets.token_urlsafe(32)
    credential = session.get(AgentCredential, node_id) or AgentCredential(node_id=node_id, secret_hash="")
    credential.secret_hash, credential.created_at, credential.revoked_at = hash_secret(secret), utcnow(), None
    session.add(credential)
    return f"gpa_{node_id}.{secret}"


def revoke(session: Session, node_ids: Iterable[str], *, now: datetime) -> None:
    """The nodes' credentials stop working now (a node that holds none is left as it is)."""
    ids = list(node_ids)
    if ids:
        session.execute(
            sa.update(AgentCredential)
            .where(col(AgentCredential.node_id).in_(ids), col(AgentCredential.revoked_at).is_(None))
            .values(revoked_at=now)
            .execution_options(synchronize_session=False)
        )


# The nodes whose credential is revoked (a select to use inside another query).
REVOKED_NODES = select(col(AgentCredential.node_id)).where(col(AgentCredential.revoked_at).is_not(None))


def revoked(session: Session, node_ids: Iterable[str]) -> set[str]:
    """Those of the nodes whose credential is revoked: they cannot report until their next wipe."""
    ids = list(node_ids)
    if not ids:
        return set()
    return set(session.exec(REVOKED_NODES.where(col(AgentCredential.node_id).in_(ids))).all())


class WipeRotation:
    """The credential a wipe hands the node's agent, and its commit once the wipe succeeded."""

    def __init__(self, db: Database, secret: str) -> None:
        self._db = db
        self._key = hashlib.sha256(b"gpucloud agent credential\0" + secret.encode()).digest()

    def next_token(self, node_id: str, request_id: str) -> str:
        mac = hmac.new(self._key, f"{node_id}\0{request_id}".encode(), hashlib.sha256).digest()
        return f"gpa_{node_id}.{base64.urlsafe_b64encode(mac).decode().rstrip('=')}"

    def commit(self, node_id: str, request_id: str) -> None:
        """Store the next credential's hash: the old one stops working (idempotent)."""
        self.commit_many([(node_id, request_id)])

    def commit_many(self, wiped: list[tuple[str, str]]) -> None:
        """`commit` for many wiped nodes ((node id, wipe request id) each) in one transaction: a
        bring-up batch wipes a hundred nodes at once."""
        if not wiped:
            return
        ids = [node_id for node_id, _ in wiped]
        now = utcnow()
        with self._db.session() as session:
            known = set(session.exec(select(col(Node.id)).where(col(Node.id).in_(ids))).all())
            held = {
                c.node_id: c
                for c in session.exec(select(AgentCredential).where(col(AgentCredential.node_id).in_(ids))).all()
            }
            for node_id, request_id in wiped:
                if node_id not in known:
                    continue
                secret_hash = hash_secret(self.next_token(node_id, request_id).rsplit(".", 1)[1])
                credential = held.get(node_id) or AgentCredential(node_id=node_id, secret_hash="")
                # Only a new credential lifts a revocation: a retried commit of a wipe from before
                # the node's last allocation must not revive the one its tenant held.
                if credential.secret_hash != secret_hash:
                    credential.secret_hash, credential.created_at, credential.revoked_at = secret_hash, now, None
                    session.add(credential)
