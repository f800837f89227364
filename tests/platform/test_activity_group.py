"""An activity group hands the worker every activity it defines, and a view reads a row by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import BaseModel
from temporalio import activity

from gpucloud.activities import ActivityGroup, view_of

pytestmark = pytest.mark.unit


class _Base(ActivityGroup):
    @activity.defn
    async def first(self) -> str:
        return "first"

    def helper(self) -> str:  # not an activity: never registered
        return "helper"


class _Group(_Base):
    @activity.defn
    async def second(self) -> str:
        return "second"


def test_all_lists_every_activity_of_the_class_and_its_bases_bound_and_nothing_else():
    group = _Group()
    listed = group.all()
    assert [fn.__name__ for fn in listed] == ["first", "second"]
    assert all(fn.__self__ is group for fn in listed)


class _View(BaseModel):
    thing_id: str
    state: str
    count: int = 0


def test_a_view_reads_its_fields_off_the_row_and_takes_the_given_ones_as_given():
    row = SimpleNamespace(id="n1", state="available", count=3, unrelated="ignored")
    assert view_of(_View, row, thing_id=row.id) == _View(thing_id="n1", state="available", count=3)
    assert view_of(_View, row, thing_id="n1", count=9).count == 9
