"""What a service refuses, in the domain's words: the errors services raise and the API answers.

Each says what was wrong (`detail`), under a stable slug (`type_`) and a title, with any members a
client reads (`members`: the quota that was exceeded, the field that was invalid). The HTTP status
follows from the class alone; `gpucloud.api.errors` turns them into problem documents, so no
service knows about HTTP and no router translates exceptions by hand.
"""

from __future__ import annotations

from typing import Any, ClassVar


class DomainError(Exception):
    """A refusal a caller can act on. Subclasses set the kind (and its HTTP status in the API)."""

    type_: ClassVar[str]
    title: ClassVar[str]

    def __init__(self, detail: str, *, type_: str | None = None, title: str | None = None, **members: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        if type_ is not None:
            self.type_ = type_  # type: ignore[misc]  # an instance's own slug
        if title is not None:
            self.title = title  # type: ignore[misc]
        self.members = members


class NotFound(DomainError):
    """No such resource visible to the caller. A foreign id gets the same answer as a missing
    one: nothing to learn about other tenants."""

    type_ = "not-found"

    def __init__(self, kind: str, ident: str, *, detail: str | None = None, title: str | None = None) -> None:
        super().__init__(detail or f"no {kind} {ident!r} visible to this caller", title=title or f"{kind} not found")
        self.kind, self.ident = kind, ident


class Forbidden(DomainError):
    """The caller may not do this (who it is, or what its credential covers)."""

    type_ = "forbidden"
    title = "Forbidden"


class Conflict(DomainError):
    """The state refuses it (it exists, it moved, the capacity or the quota is not there)."""

    type_ = "conflict"
    title = "Conflict"


class Invalid(DomainError):
    """The request is invalid: `field` names what, `message` why (a 422 naming the field, as a
    validation error does)."""

    type_ = "invalid-request"
    title = "The request is invalid"

    def __init__(
        self,
        field: str,
        message: str,
        type_: str | None = None,
        *,
        title: str | None = None,
        detail: str | None = None,
        errors: list[dict[str, str]] | None = None,
    ) -> None:
        errors = errors or [{"field": field, "message": message}]
        super().__init__(detail or f"{field}: {message}", type_=type_, title=title, errors=errors)
        self.field, self.message = field, message


class QuotaExceeded(Conflict):
    """Granting it would take the tenant past a quota (members say which, and what is left)."""

    type_ = "quota-exceeded"
    title = "Quota exceeded"


class Unavailable(DomainError):
    """Not now: contention or an outside system that did not answer; nothing was lost, the same
    request may be sent again (after `retry_after_s`, when the service knows when)."""

    type_ = "unavailable"
    title = "Try again"

    def __init__(
        self,
        detail: str,
        *,
        type_: str | None = None,
        title: str | None = None,
        retry_after_s: int | None = None,
        **members: Any,
    ) -> None:
        super().__init__(detail, type_=type_, title=title, **members)
        self.retry_after_s = retry_after_s


class Broken(DomainError):
    """Something stored is not what it should be (a manifest that fails its own check): the
    caller cannot fix it; operators must."""

    type_ = "internal"
    title = "Internal error"
