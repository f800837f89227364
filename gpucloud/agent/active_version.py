"""Which assembled version a node serves: the `current` and `previous` pointers.

    current -> versions/<digest>    the active version: what a model server loads
    previous -> versions/<digest>   the version before it, kept on disk for rollback

Both are relative symlinks replaced with `os.replace` (and the directory fsynced), so a reader
opening `current/<file>` sees the old version or the new one, never a mix. A version becomes
current only after `verify` (the caller's: `VersionFiles.verify`) passes, whether it is
activated or rolled back to. `switch` serialises every move of the pointers; housekeeping that
must not race a switch (discarding or pruning versions) holds it too.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

from gpucloud.storage.local import fsync_path

CURRENT = "current"
PREVIOUS = "previous"


class NoPreviousVersionError(LookupError):
    """Rollback was asked for, but no previous version is kept."""


class ActiveVersion:
    """The pointers under `root`; `verify(digest)` raises unless the version's files are intact."""

    def __init__(self, root: Path, *, verify: Callable[[str], object]) -> None:
        self.root = root
        self._verify = verify
        self.switch = threading.Lock()

    def active(self) -> str | None:
        return self._target(CURRENT)

    def previous(self) -> str | None:
        return self._target(PREVIOUS)

    def in_use(self) -> set[str]:
        """The versions the pointers name (call with `switch` held for an answer that stays true)."""
        return {d for d in (self.active(), self.previous()) if d is not None}

    @property
    def current_path(self) -> Path:
        """Where a model server loads the active version from."""
        return self.root / CURRENT

    def activate(self, digest: str) -> Path:
        """Verify the version, then make it current; the version it replaces becomes previous."""
        with self.switch:
            self._verify(digest)
            current = self.active()
            if current == digest:
                return self.current_path
            # previous first: a crash between the two switches leaves previous == current, which
            # a rollback turns into a no-op, never into an unknown version.
            if current is not None:
                self._point(PREVIOUS, current)
            self._point(CURRENT, digest)
        return self.current_path

    def rollback(self) -> str:
        """Make the previous version current again (verified first); return its digest."""
        with self.switch:
            previous = self.previous()
            if previous is None:
                raise NoPreviousVersionError("no previous version is kept on this node")
            self._verify(previous)
            self._point(CURRENT, previous)
            (self.root / PREVIOUS).unlink()
            fsync_path(self.root)
        return previous

    def deactivate(self, digest: str) -> bool:
        """Stop serving `digest` where no previous version is kept to go back to (the node ran
        nothing before it): `current` goes, the files stay. False if `digest` is not current."""
        with self.switch:
            if self.active() != digest:
                return False
            (self.root / CURRENT).unlink()
            fsync_path(self.root)
        return True

    def _target(self, name: str) -> str | None:
        try:
            return Path(os.readlink(self.root / name)).name
        except FileNotFoundError:
            return None

    def _point(self, name: str, digest: str) -> None:
        link = self.root / f".{name}.{uuid.uuid4().hex}"
        os.symlink(f"versions/{digest}", link)  # relative, so the cache root may move
        os.replace(link, self.root / name)
        fsync_path(self.root)
