"""The operator's rollouts, as the API's `/v1/rollouts` answers them (`services/rollout_requests`):

- the list (every tenant's, newest first, as the workflow engine's index orders them): model and
  version, the workflow's status, the wave under way (asked of the running ones' workflows), and
  when it started;
- one rollout: its phase, its waves with each node's outcome, what was rolled back or dropped;
- pause, resume and abort, each with a reason and a ticked confirmation, through the same service
  call as `POST /v1/rollouts/{id}:pause|:resume|:abort` (`rollout_requests.send_command`: the
  workflow's update through the one Temporal gateway, and a settled operation naming the operator).
"""

from __future__ import annotations

import base64
import binascii
import functools
from typing import Any

from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError

from gpucloud.api.deps import DbDep, ReadsDep, TemporalDep
from gpucloud.api.deps import FleetOperatorDep as FleetOperator
from gpucloud.api.deps import ReadOperatorDep as ReadOperator
from gpucloud.console import web
from gpucloud.console.session import PREFIX
from gpucloud.models.api_schemas import RolloutCommand
from gpucloud.models.rollout_messages import RolloutProgress
from gpucloud.services import rollout_requests as requests
from gpucloud.services.errors import Conflict
from gpucloud.web.problems import field_of, invalid, not_found

router = web.pages_router()
LISTED = 50
# The commands an operator may give, and what the page calls each (`requests.UPDATES`).
COMMANDS = {
    "pause": ("Pause", "paused: the next wave waits until it is resumed"),
    "resume": ("Resume", "resumed"),
    "abort": ("Abort", "aborted: the nodes it reached are rolled back"),
}


def _token(page: str) -> bytes | None:
    """The engine's page token the previous page's link carried (URL-safe base64)."""
    if not page:
        return None
    try:
        return base64.urlsafe_b64decode(page.encode())
    except (binascii.Error, ValueError):
        raise invalid("page", "not a page token this console issued") from None


@router.get("/rollouts")
async def rollouts_page(
    request: Request, operator: ReadOperator, temporal: TemporalDep, reads: ReadsDep, page: str = ""
) -> Response:
    items, token = await requests.list_rollouts(
        temporal, tenant_id=None, page_size=LISTED, next_page_token=_token(page.strip())
    )
    progress = await requests.progress_of(temporal, [r.rollout_id for r in items if r.status == "running"])

    def names() -> dict[str, str]:
        with reads() as session:
            return requests.model_names(session, items)

    models = await run_in_threadpool(names)
    return web.page(
        request,
        "rollouts.html",
        rollouts=items,
        progress=progress,
        models=models,
        next_page=base64.urlsafe_b64encode(token).decode() if token else "",
        listed=LISTED,
    )


async def _rollout_page(request: Request, temporal: Any, reads: Any, rollout_id: str, **context: Any) -> Response:
    progress: RolloutProgress = await requests.visible(temporal, rollout_id, tenant_id=None, operator=True)

    def names() -> dict[str, str]:
        with reads() as session:
            return requests.model_names(session, [progress])

    model = (await run_in_threadpool(names)).get(progress.rollout_id)
    return web.page(
        request,
        "rollout.html",
        rollout=progress,
        model=model,
        commands=COMMANDS,
        errors=context.pop("errors", {}),
        values=context.pop("values", {}),
        failed_command=context.pop("failed_command", None),
        form_error=context.pop("form_error", None),
        notice=context.pop("notice", None),
        status=context.pop("status", 200),
    )


@router.get("/rollouts/{rollout_id}")
async def rollout_page(
    request: Request, rollout_id: str, operator: ReadOperator, temporal: TemporalDep, reads: ReadsDep, done: str = ""
) -> Response:
    notice = f"Rollout {COMMANDS[done][1]}." if done in COMMANDS else None
    return await _rollout_page(request, temporal, reads, rollout_id, notice=notice)


@router.post("/rollouts/{rollout_id}/{command}")
async def rollout_command(
    request: Request,
    rollout_id: str,
    command: str,
    operator: FleetOperator,
    temporal: TemporalDep,
    reads: ReadsDep,
    db: DbDep,
) -> Response:
    """Pause, resume or abort, as the API's commands are given: a reason (kept with the
    operation) and a ticked confirmation; the workflow's refusal is shown beside the command."""
    if command not in COMMANDS:
        raise not_found("rollout command", command)
    fields = await web.form(request)
    reason = fields.get("reason", "").strip()
    errors: dict[str, str] = {}
    body = None
    if not reason:
        errors["reason"] = "say why (it is kept with the operation, with your name)"
    try:
        body = RolloutCommand.model_validate({"reason": reason})
    except ValidationError as exc:
        for error in exc.errors():
            errors.setdefault(field_of(tuple(error.get("loc", ()))), error.get("msg", "invalid"))
    if fields.get("confirm") != "yes":
        errors["confirm"] = "tick the box to confirm"
    again = functools.partial(
        _rollout_page, request, temporal, reads, rollout_id, values={"reason": reason}, failed_command=command
    )
    if errors or body is None:
        return await again(errors=errors, status=422)
    try:
        await requests.send_command(
            temporal, db, rollout_id, command, body, tenant_id=None, operator=True, actor=operator.actor
        )
    except Conflict as refused:
        return await again(form_error=f"{refused.title}: {refused.detail}", status=409)
    return web.see_other(f"{PREFIX}/rollouts/{rollout_id}?done={command}")
