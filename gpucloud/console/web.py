"""What every console page shares: the templates, the form reader, the CSRF check, the
dependencies that send a visitor to sign in, and the route class that answers a refusal (a
problem or a domain error) with an HTML page instead of problem+json.

Pages are rendered on the server; the only scripts are files the package ships
(`console/static/`), so the Content-Security-Policy allows no inline script and nothing from
another origin.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qsl, quote, urlencode

import jinja2
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import HTMLResponse
from fastapi.routing import APIRoute

from gpucloud.api import errors as api_errors
from gpucloud.api.auth import Caller
from gpucloud.console.session import PREFIX
from gpucloud.services.errors import DomainError
from gpucloud.web.problems import Problem

HERE = Path(__file__).parent
TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(HERE / "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
FORM_TYPE = "application/x-www-form-urlencoded"
# The shared nav: each role's pages, in the order they are listed (`docs/console.md`).
OPERATOR_NAV = (
    ("/fleet", "Fleet"),
    ("/allocations", "Allocations"),
    ("/queue", "Queue"),
    ("/reservations", "Reservations"),
    ("/tenants", "Tenants"),
    ("/rollouts", "Rollouts"),
    ("/billing", "Billing"),
    ("/incidents", "Incidents"),
    ("/alerts", "Alerts"),
)
TENANT_NAV = (
    ("/allocations", "Allocations"),
    ("/queue", "Queue"),
    ("/reservations", "Reservations"),
    ("/incidents", "Incidents"),
    ("/usage", "Usage & invoices"),
    ("/models", "Models"),
    ("/api-keys", "API keys"),
)


def nav_links(caller: Caller) -> tuple[tuple[str, str], ...]:
    return OPERATOR_NAV if caller.is_operator else TENANT_NAV


def when(at: Any) -> str:
    """A timestamp as the pages show it (UTC, to the second); a dash for none."""
    return at.strftime("%Y-%m-%d %H:%M:%S") if at is not None else "—"


TEMPLATES.globals.update(nav_links=nav_links)
TEMPLATES.filters.update(when=when)


def page(request: Request, template: str, *, status: int = 200, **context: Any) -> HTMLResponse:
    state = request.state
    caller: Caller | None = getattr(state, "caller", None)
    html = TEMPLATES.get_template(template).render(
        prefix=PREFIX,
        caller=caller if caller is not None and caller.role in ("tenant", "operator") else None,
        csrf_token=getattr(state, "console_csrf", None) or "",
        path=request.url.path,
        **context,
    )
    return HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)


def pager(path: str, filters: dict[str, str], token: str, page_token: str) -> dict[str, Any]:
    """A keyset-paginated list's links for the `pager` macro (`_macros.html`): the next page
    (`token`, the last page's when '') and the first, each keeping the filters set; `later_page`
    when this one was asked for with a `page_token`."""
    shown = {name: value for name, value in filters.items() if value}
    first = f"{PREFIX}{path}" + (f"?{urlencode(shown)}" if shown else "")
    return {
        "next_link": f"{PREFIX}{path}?" + urlencode({**shown, "page_token": token}) if token else None,
        "later_page": bool(page_token.strip()),
        "first_link": first,
    }


def see_other(location: str, *, headers: dict[str, str] | None = None) -> Response:
    return Response(status_code=303, headers={"Location": location, **SECURITY_HEADERS, **(headers or {})})


async def form(request: Request) -> dict[str, str]:
    """The fields of a URL-encoded form (the last value of a repeated field); the gate has
    already bounded the body's size and read time."""
    cached = getattr(request.state, "console_form", None)
    if cached is not None:
        return cached
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != FORM_TYPE:
        raise Problem(415, "unsupported-media-type", "Send a form", f"console forms are {FORM_TYPE}")
    fields = dict(parse_qsl((await request.body()).decode("utf-8", "replace"), keep_blank_values=True))
    request.state.console_form = fields
    return fields


def csrf_refused(detail: str) -> Problem:
    return Problem(403, "csrf-token-invalid", "Form expired or forged", detail)


async def csrf_checked(request: Request) -> None:
    """Every POST of a signed-in page carries the session's CSRF token in its `csrf_token` field."""
    if request.method != "POST":
        return
    expected = getattr(request.state, "console_csrf", None)
    if not expected:  # no session: refused before the body is read
        raise csrf_refused("there is no console session to send this form from: sign in, then send it again")
    sent = (await form(request)).get("csrf_token", "")
    if not sent or not hmac.compare_digest(sent.encode(), expected.encode()):
        raise csrf_refused("the form's CSRF token is missing or not this session's: reload the page and send it again")


async def signed_in(request: Request) -> Caller:
    """The signed-in caller; a visitor is sent to sign in (and back here after, for a GET)."""
    caller: Caller | None = getattr(request.state, "caller", None)
    if caller is None or caller.role not in ("tenant", "operator"):
        after = f"?next={quote(request.url.path, safe='/')}" if request.method == "GET" else ""
        raise Problem(
            303, "sign-in-required", "Sign in", "sign in first", headers={"Location": f"{PREFIX}/sign-in{after}"}
        )
    return caller


SignedInDep = Annotated[Caller, Depends(signed_in)]


class ConsoleRoute(APIRoute):
    """A console route: a refusal is an HTML page with the problem's status and words."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Problem as problem:
                return refusal(request, problem)
            except DomainError as error:
                return refusal(request, api_errors.problem_for(error))

        return route


def refusal(request: Request, problem: Problem) -> Response:
    if problem.status == 303:
        return see_other(problem.headers["Location"])
    response = page(
        request,
        "error.html",
        status=problem.status,
        title=problem.title,
        detail=problem.detail,
        status_code=problem.status,
    )
    response.headers.update({k: v for k, v in problem.headers.items() if k.lower() == "retry-after"})
    return response


def pages_router() -> APIRouter:
    """A router of the console's signed-in pages: a visitor is sent to sign in, and every form
    must carry the session's CSRF token (each page module makes its own with this)."""
    return APIRouter(
        prefix=PREFIX,
        route_class=ConsoleRoute,
        include_in_schema=False,
        dependencies=[Depends(signed_in), Depends(csrf_checked)],
    )
