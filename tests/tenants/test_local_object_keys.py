"""The local object store maps a key to a file inside its root and nowhere else: keys are checked
by their segments (no absolute paths, no `..`, nothing in the store's own temp folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpucloud.storage.local import LocalObjectStore

pytestmark = pytest.mark.unit


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "objects")


@pytest.mark.parametrize(
    "key",
    ["../outside", "a/../../outside", "a/..", "/etc/passwd", "", "/", ".", "./", "tmp/abc", "./tmp/abc", "a\0b"],
)
def test_a_key_that_leaves_the_objects_is_refused(store: LocalObjectStore, key: str) -> None:
    with pytest.raises(ValueError, match="leaves the store's objects"):
        store.path(key)
    with pytest.raises(ValueError):
        store.put(key, b"x")


@pytest.mark.parametrize(
    ("key", "relative"),
    [
        ("tenants/t1/chunks/ab/cd/abcd", "tenants/t1/chunks/ab/cd/abcd"),
        ("a//b", "a/b"),
        ("a/./b/", "a/b"),
        ("data/tmp/x", "data/tmp/x"),  # only the root's own temp folder is off limits
        ("weights..v2/model", "weights..v2/model"),
    ],
)
def test_keys_inside_the_objects_map_to_files_there(store: LocalObjectStore, key: str, relative: str) -> None:
    path = store.path(key)
    assert path == store.root / relative
    store.put(key, b"payload")
    assert path.read_bytes() == b"payload" and store.get(key) == b"payload"
    assert path.resolve().is_relative_to(store.root)
