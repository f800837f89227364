"""`gpucloud operators`: named operator accounts (an admin's token: `GPUCLOUD_API__OPERATOR_TOKEN`
or the CLI's context's, or `--api-key` with an admin's `gpo_...` token), as tables or `--output json`.

A token is printed once, when it is created or rotated; the server keeps only its hash.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import typer
from rich.table import Table

from gpucloud.cli.common import ApiKey, ApiUrl, Output, api_client, console, parse_duration, reported_errors
from gpucloud.cli.resources import _when, emit
from gpucloud.models.operator_roles import Role

operators_app = typer.Typer(no_args_is_help=True, help="Operator accounts (admin): create, list, rotate, revoke.")
ExpiresIn = Annotated[
    str | None, typer.Option("--expires-in", help="the token's lifetime, like 30d or 12h (default: the API's)")
]


def _table(accounts: list) -> Table:
    table = Table("name", "role", "created", "created by", "revoked", "live tokens", "expires", title="operators")
    for a in accounts:
        live = [t for t in a.tokens if t.revoked_at is None and t.replaced_by is None]
        table.add_row(
            a.name,
            a.role,
            _when(a.created_at),
            a.created_by,
            _when(a.revoked_at),
            str(len(live)),
            _when(max((t.expires_at for t in live), default=None)),
        )
    return table


def _issued(output: str, issued: Any) -> None:
    if output == "json":
        emit(output, issued)
        return
    console.print(
        f"operator {issued.operator.name} ({issued.operator.role}), token {issued.token_id} (shown once, "
        f"expires {_when(issued.expires_at)}): [bold]{issued.token}[/]"
    )
    if issued.replaces:
        console.print(f"replaces {issued.replaces}, which stops working at {_when(issued.replaced_token_expires_at)}")


def _seconds(expires_in: str | None) -> int | None:
    return None if expires_in is None else parse_duration(expires_in, option="--expires-in")


@operators_app.command("create")
def operators_create(
    name: str,
    role: Annotated[Role, typer.Option("--role", help="what the operator may do")],
    expires_in: ExpiresIn = None,
    output: Output = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """A named operator and its first token (shown once, here)."""
    seconds = _seconds(expires_in)
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        issued = api.operators.create(name, role.value, expires_in_s=seconds, idempotency_key=str(uuid.uuid4()))
    _issued(output, issued)


@operators_app.command("list")
def operators_list(output: Output = "table", api_url: ApiUrl = None, api_key: ApiKey = None) -> None:
    """Every named operator, with its tokens (never their secrets)."""
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        accounts = api.operators.list().items
    emit(output, accounts, _table(accounts))


@operators_app.command("rotate")
def operators_rotate(
    name: str,
    grace: Annotated[str, typer.Option(help="how long the old token keeps working, like 1h (0: not at all)")] = "0",
    expires_in: ExpiresIn = None,
    output: Output = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """A new token for the operator; the old one keeps working for --grace."""
    grace_s, seconds = parse_duration(grace, option="--grace"), _seconds(expires_in)
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        issued = api.operators.rotate(name, grace_period_s=grace_s, expires_in_s=seconds)
    _issued(output, issued)


@operators_app.command("revoke")
def operators_revoke(name: str, output: Output = "table", api_url: ApiUrl = None, api_key: ApiKey = None) -> None:
    """End the operator and all its tokens at once."""
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        account = api.operators.revoke(name)
    emit(output, account, _table([account]))
