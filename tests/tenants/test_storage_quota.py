"""Issue 37, item 10: the registry's storage quota is checked and counted in one statement.

Before: an upload read the usage, compared it with the quota, took the body, then added its size;
uploads running at once were all admitted against the same count and passed the quota together.
Now each reserves its size in one conditional UPDATE before its body is read, on SQLite and Postgres."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpucloud.services import storage_quota
from gpucloud.web.problems import Problem

pytestmark = pytest.mark.integration

CHUNK = 64 << 20
QUOTA = 10 * CHUNK


def test_uploads_racing_for_the_last_of_a_quota_never_pass_it(db_url: str) -> None:
    racers = 32
    start = threading.Barrier(racers)

    def upload(_: int) -> bool:
        start.wait()
        try:
            storage_quota.reserve(db_url, "ten_racing", CHUNK, QUOTA)
        except Problem as refused:
            assert refused.status == 409 and refused.extra["quota_bytes"] == QUOTA
            return False
        return True

    with ThreadPoolExecutor(racers) as pool:
        admitted = sum(pool.map(upload, range(racers)))
    assert admitted == QUOTA // CHUNK  # the tenant's first upload made the row while others raced it
    assert storage_quota.usage(db_url, "ten_racing") == QUOTA


def test_a_reservation_that_stored_nothing_is_given_back(db_url: str) -> None:
    storage_quota.reserve(db_url, "ten_back", QUOTA, QUOTA)
    with pytest.raises(Problem) as full:
        storage_quota.reserve(db_url, "ten_back", 1, QUOTA)
    assert (full.value.extra["usage_bytes"], full.value.status) == (QUOTA, 409)
    storage_quota.release(db_url, "ten_back", CHUNK)
    storage_quota.reserve(db_url, "ten_back", CHUNK, QUOTA)
    # Never below zero: a garbage collection measured the store in between.
    storage_quota.measured(db_url, "ten_back", 5)
    storage_quota.release(db_url, "ten_back", CHUNK)
    assert storage_quota.usage(db_url, "ten_back") == 0
    with pytest.raises(Problem):  # one chunk past the quota on a tenant's first upload
        storage_quota.reserve(db_url, "ten_new", QUOTA + 1, QUOTA)
    assert storage_quota.usage(db_url, "ten_new") == 0
