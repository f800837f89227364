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
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

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
    credential.secret_hash, credential.created_at = hash_secret(secret), utcnow()
    session.add(credential)
    return f"gpa_{node_id}.{secret}"


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
                if credential.secret_hash != secret_hash:
                    credential.secret_hash, credential.created_at = secret_hash, now
                    session.add(credential)
