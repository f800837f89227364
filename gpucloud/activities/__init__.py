"""Temporal activities: the only code the workflows reach the outside world through."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel

View = TypeVar("View", bound=BaseModel)


class ActivityGroup:
    """Activities that share their clients: every `@activity.defn` method, which `all()` hands a
    worker bound to this instance (so none can be defined and left unregistered)."""

    def all(self) -> list[Callable[..., Any]]:
        names: dict[str, None] = {}
        for klass in reversed(type(self).__mro__):
            names.update((name, None) for name, value in vars(klass).items() if _is_activity(value))
        return [getattr(self, name) for name in names]


def _is_activity(value: object) -> bool:
    # What `@activity.defn` leaves on the function (temporalio has no public test for it).
    return callable(value) and hasattr(value, "__temporal_activity_definition")


def view_of(view: type[View], row: object, **given: Any) -> View:
    """What a workflow sees of a row: the `given` fields (a renamed id, a converted value), and
    every other field of `view` read off the row by its name."""
    read = {name: getattr(row, name) for name in view.model_fields if name not in given}
    return view(**read, **given)
