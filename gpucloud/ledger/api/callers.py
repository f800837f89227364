"""Who may call the ledger, checked by its gate before any handler reads a body.

Every call carries a token the control plane signed for the ledger (`aud` = `ledger`,
`web/service_tokens.py`), verified offline with the control plane's public key:

- `agent` (`sub` = `node:<id>`): a node's agent, with a token the API gives it for its own
  credential (`POST /v1/agents/ledger-token`): posts usage for its own node only;
- `control-plane`: the API and the workers: allocation events, capacity reservations, period
  closes, every read;
- `operator`: an operator, through the API: the price book, reversals, usage corrections,
  period closes, every read.

Only `/healthz`, `/readyz` and the OpenAPI document are open.
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Scope

from gpucloud.ledger.problems import PROBLEM_BASE
from gpucloud.web import problems
from gpucloud.web.gate import Check
from gpucloud.web.service_tokens import LEDGER_AUDIENCE as AUDIENCE
from gpucloud.web.service_tokens import InvalidToken, Verifier

# `/metrics` checks its own token (the metrics or the operator token).
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/redoc"})
READERS = frozenset({"control-plane", "operator"})
ROLES = ("agent", "control-plane", "operator")
# (method, path) -> the roles that may call it; the first match wins.
RULES: tuple[tuple[str, re.Pattern[str], frozenset[str]], ...] = (
    ("POST", re.compile(r"^/v1/usage:batch$"), frozenset({"agent", "operator"})),
    ("POST", re.compile(r"^/v1/allocation-events$"), frozenset({"control-plane"})),
    ("POST", re.compile(r"^/v1/reservations$"), frozenset({"control-plane"})),
    ("POST", re.compile(r"^/v1/periods/[^/]+:close$"), READERS),
    ("POST", re.compile(r"^/v1/price-book/versions$"), frozenset({"operator"})),
    ("POST", re.compile(r"^/v1/postings/\d+:reverse$"), frozenset({"operator"})),
    ("GET", re.compile(r".*"), READERS),
)


def allowed_roles(method: str, path: str) -> frozenset[str]:
    for rule_method, pattern, roles in RULES:
        if method == rule_method and pattern.match(path):
            return roles
    return frozenset({"operator"})  # anything else changes the books: operators only


def ledger_callers(verifier: Verifier) -> Check:
    """The ledger's credential check for its gate (`web/gate.py`): 401 without a valid token,
    403 for a role the route does not admit; the claims go to the handlers in
    `scope["state"]["claims"]`."""

    async def check(scope: Scope) -> ASGIApp | None:
        if scope["path"] in OPEN_PATHS:
            return None
        header = problems.header(scope, b"authorization")
        roles = allowed_roles(scope["method"], scope["path"])
        try:
            claims = verifier.check_header(header, audience=AUDIENCE, roles=ROLES)
        except InvalidToken as exc:
            detail = f"the ledger takes only tokens the control plane signed for it ({exc})"
            return problems.unauthenticated(detail, type_=PROBLEM_BASE + "unauthenticated")
        if claims.role not in roles:
            detail = (
                f"a {claims.role} token may not {scope['method']} {scope['path']} (allowed: {', '.join(sorted(roles))})"
            )
            document = problems.body(403, "forbidden", "Forbidden", detail)
            document["type"] = PROBLEM_BASE + "forbidden"
            return problems.response(document, 403)
        scope.setdefault("state", {})["claims"] = claims
        return None

    return check
