"""Who uses the console: the session cookie, read by the API's gate (`api/gate.py`) before
admission, turned into the same `Caller` a bearer token would be, so the console's requests take
the same lanes, limits and audit names as the API's.

A request to a console path without a live session is a `VISITOR`: it may load the sign-in page
and the static files, and every other page sends it there (`console/pages.py`).
"""

from __future__ import annotations

import re
from datetime import timedelta
from http.cookies import CookieError, SimpleCookie

import sqlalchemy as sa
from starlette.types import Scope

from gpucloud.api.auth import Caller
from gpucloud.models.operator_roles import ROLE_SCOPES, Role
from gpucloud.services import console_sessions
from gpucloud.web import problems

PREFIX = "/console"
COOKIE = "gpucloud_console"
# The sign-in form's own CSRF token (double submit), before there is a session to hold one.
SIGN_IN_COOKIE = "gpucloud_console_sign_in"
TTL = timedelta(hours=8)
VISITOR = Caller(role="visitor")


def is_console(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def cookie(scope: Scope, name: str) -> str | None:
    raw = problems.header(scope, b"cookie")
    if not raw:
        return None
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(raw)
    except CookieError:
        return None
    morsel = jar.get(name)
    return morsel.value if morsel is not None and morsel.value else None


# What `console_sessions` issues: 32 random bytes, URL-safe base64 (43 characters).
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{43}")


def session_cookie(scope: Scope) -> str | None:
    """The session id the request carries, where one could be (a static file needs none, and a
    cookie of another shape is no session of ours): no lookup is made for anything else."""
    if scope.get("path", "").startswith(f"{PREFIX}/static/"):
        return None
    value = cookie(scope, COOKIE)
    return value if value is not None and _SESSION_ID.fullmatch(value) else None


def caller_of(principal: console_sessions.Principal) -> Caller:
    if principal.role == "tenant":
        return Caller(role="tenant", tenant_id=principal.tenant_id, key_id=principal.credential_id)
    return Caller(
        role="operator", operator=principal.operator, scopes=ROLE_SCOPES[Role(principal.operator_role or "read-only")]
    )


def resolve(connection: sa.Connection, scope: Scope, operator_token: str) -> tuple[Caller, str | None]:
    """(who calls, the session's CSRF token) for a console request; a visitor without a live
    session. The session id found is left in the scope's state for sign-out."""
    session_id = session_cookie(scope)
    if session_id is None:
        return VISITOR, None
    principal = console_sessions.find(connection, session_id, bootstrap_token=operator_token)
    if principal is None:
        return VISITOR, None
    scope.setdefault("state", {})["console_session"] = session_id
    return caller_of(principal), principal.csrf_token
