"""Host-agent credentials: one per node, issued by an operator, shown once.

The agent on a node presents `gpa_<node id>.<secret>`; the API lets it report heartbeats, XID
events and readings for that node only (`api.deps.ReporterDep`). Tenants have root on the nodes
they rent, so what the agent holds must not be worth more than the node itself: never the
operator token. Issuing a credential again replaces the old one (rotation, or a re-imaged node).
"""

from __future__ import annotations

import secrets

from sqlmodel import Session

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
