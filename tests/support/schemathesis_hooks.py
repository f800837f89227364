"""Checks of ours that the schemathesis CLI loads (`SCHEMATHESIS_HOOKS=support.schemathesis_hooks`)."""

from __future__ import annotations

import schemathesis


@schemathesis.check
def only_declared_unavailability(ctx, response, case) -> None:
    """No 5xx but a 503 that says when to come back (`Retry-After`), or a 501 for what this
    deployment does not do (billing without a ledger)."""
    status = response.status_code
    if status >= 500 and status != 501 and not (status == 503 and response.headers.get("retry-after")):
        raise AssertionError(f"{status} without Retry-After: {response.text[:300]}")
