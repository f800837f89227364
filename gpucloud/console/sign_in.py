"""Sign in with an operator token or a tenant API key, sign out; the static files.

The credential is posted once, in the sign-in form's body, checked as the API checks a bearer
token (`api/auth.resolve`), and kept server-side: the browser gets only a random session id in
an HttpOnly, SameSite=Strict cookie (Secure over TLS). The sign-in form has no session yet, so
its CSRF token is a double submit: a random value in a cookie of its own and in the form.
"""

from __future__ import annotations

import hmac
import secrets
from importlib import resources

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool

from gpucloud.api import auth
from gpucloud.api.deps import DbDep, SettingsDep
from gpucloud.console import web
from gpucloud.console.session import COOKIE, PREFIX, SIGN_IN_COOKIE, TTL
from gpucloud.db import Database, get_read_engine
from gpucloud.services import console_sessions, operators

router = APIRouter(prefix=PREFIX, route_class=web.ConsoleRoute, include_in_schema=False)

STATIC = {
    "console.css": "text/css; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "htmx.min.js": "text/javascript; charset=utf-8",
}


def _home(caller: auth.Caller) -> str:
    return f"{PREFIX}/fleet" if caller.is_operator else f"{PREFIX}/allocations"


def _next(target: str | None, caller: auth.Caller) -> str:
    """Where to go after signing in: a console page named by `next`, never another site."""
    if target and target.startswith(PREFIX + "/") and "//" not in target and "\\" not in target:
        return target
    return _home(caller)


def _cookie(response: Response, request: Request, name: str, value: str, *, max_age: int) -> None:
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path=PREFIX,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


@router.get("")
async def console_root(request: Request) -> Response:
    caller = await web.signed_in(request)
    return web.see_other(_home(caller))


@router.get("/sign-in")
async def sign_in_page(request: Request, next: str | None = None) -> Response:
    caller = request.state.caller
    if caller.role in ("tenant", "operator"):
        return web.see_other(_next(next, caller))
    return _form(request, next=next)


def _form(request: Request, *, next: str | None, error: str | None = None, status: int = 200) -> Response:
    token = secrets.token_urlsafe(32)
    response = web.page(request, "sign_in.html", status=status, sign_in_csrf=token, next=next or "", error=error)
    _cookie(response, request, SIGN_IN_COOKIE, token, max_age=3600)
    return response


@router.post("/sign-in")
async def sign_in(request: Request, db: DbDep, settings: SettingsDep) -> Response:
    fields = await web.form(request)
    expected = request.cookies.get(SIGN_IN_COOKIE, "")
    sent = fields.get("csrf_token", "")
    if not expected or not sent or not hmac.compare_digest(sent.encode(), expected.encode()):
        raise web.csrf_refused("the sign-in form's CSRF token is missing or does not match: reload the page")
    token = fields.get("token", "").strip()
    next_ = fields.get("next") or None
    operator_token = settings.operator_token
    caller = None
    if token and auth.has_credential_shape(token, operator_token):
        caller = await run_in_threadpool(_resolve, settings.database_url, token, operator_token)
    if caller is None or caller.role not in ("tenant", "operator"):
        error = "That is not a live operator token or tenant API key."
        return _form(request, next=next_, error=error, status=401)
    session_id = await run_in_threadpool(_open, db, caller, token, operator_token)
    response = web.see_other(_next(next_, caller))
    _cookie(response, request, COOKIE, session_id, max_age=int(TTL.total_seconds()))
    response.delete_cookie(SIGN_IN_COOKIE, path=PREFIX)
    return response


def _resolve(database_url: str, token: str, operator_token: str) -> auth.Caller | None:
    with get_read_engine(database_url).connect() as connection:
        return auth.resolve(connection, token, operator_token)


def _credential_id(caller: auth.Caller, token: str, operator_token: str) -> str:
    if caller.role == "tenant":
        return caller.key_id or ""
    if hmac.compare_digest(token.encode(), operator_token.encode()):
        return console_sessions.BOOTSTRAP
    return token[len(operators.TOKEN_PREFIX) :].split(".", 1)[0]


def _open(db: Database, caller: auth.Caller, token: str, operator_token: str) -> str:
    credential_id = _credential_id(caller, token, operator_token)
    # Hashed as the credential's own row hashes it (`auth.resolve`), to be compared on each request.
    secret = token if credential_id == console_sessions.BOOTSTRAP else token.split(".", 1)[1]
    with db.session() as session:
        session_id, _ = console_sessions.open_session(
            session,
            role=caller.role,
            credential_id=credential_id,
            secret=secret,
            tenant_id=caller.tenant_id,
            ttl=TTL,
        )
    return session_id


@router.post("/sign-out", dependencies=[Depends(web.signed_in), Depends(web.csrf_checked)])
async def sign_out(request: Request, caller: web.SignedInDep, db: DbDep) -> Response:
    session_id = request.state.console_session

    def close() -> None:
        with db.session() as session:
            console_sessions.close(session, session_id)

    await run_in_threadpool(close)
    response = web.see_other(f"{PREFIX}/sign-in")
    response.delete_cookie(COOKIE, path=PREFIX)
    return response


@router.get("/static/{name}")
async def static(name: str) -> Response:
    if name not in STATIC:
        return Response(status_code=404)
    body = (resources.files("gpucloud.console") / "static" / name).read_bytes()
    return Response(body, media_type=STATIC[name], headers={"Cache-Control": "public, max-age=3600"})
