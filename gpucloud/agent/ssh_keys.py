"""The tenant's SSH keys on a real node: the workload's public keys written to the login user's
authorized_keys at provision, and that file removed at release and wipe.

The agent runs as root and the login user (`--ssh-user`, the image's, `ubuntu` by default)
belongs to the tenant, who may have replaced its `~/.ssh` with a link to a file of root's while
it held the node. So the file is written and removed only where neither its `.ssh` nor the home
above is a symbolic link (a link would make root write, or delete, what it points at; what lies
above the home is the image's; a link in the file's own place is replaced or removed, never
followed), written whole
to a new file that replaces the old one (a reader never sees half of it), 0600 in a 0700 `.ssh`,
both owned by the user when the agent runs as root. Removal takes the whole file, the keys the
tenant added itself included, and ends the user's processes, its open sessions among them: after
a release no key of the tenant opens the node, and no session it opened stays.
"""

from __future__ import annotations

import os
import pwd
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

# The new file is written beside the old one under this prefix, then renamed over it.
NEW_PREFIX = ".gpucloud-new."


class KeysNotWritten(RuntimeError):
    """The keys could not be put in place, or taken out; the message says where and why."""


class AuthorizedKeys:
    """The login user's authorized_keys: `path`, or `~user/.ssh/authorized_keys` (looked up at
    each call: the user is the image's, and a node without it says so at provision)."""

    def __init__(self, user: str, *, path: Path | None = None) -> None:
        self.user, self._path = user, path

    def path(self) -> Path:
        if self._path is not None:
            return self._path
        try:
            home = pwd.getpwnam(self.user).pw_dir
        except KeyError:
            raise KeysNotWritten(
                f"no user {self.user!r} on this node: build the image with it, or start the agent with "
                "--ssh-user naming the image's login user"
            ) from None
        return Path(home) / ".ssh" / "authorized_keys"

    def install(self, keys: Sequence[str]) -> Path | None:
        """Exactly `keys` let in (none: the file removed). Returns the file written."""
        if not keys:
            self.remove()
            return None
        path = self.path()
        _no_links(path.parent)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        owner = self._owner()
        body = "".join(" ".join(k.split()) + "\n" for k in keys).encode()
        with _directory(path.parent) as ssh_dir:
            os.fchmod(ssh_dir, 0o700)
            if owner is not None:
                os.fchown(ssh_dir, *owner)
            _unlink(NEW_PREFIX + path.name, ssh_dir)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            fd = os.open(NEW_PREFIX + path.name, flags, 0o600, dir_fd=ssh_dir)
            try:
                os.write(fd, body)
                os.fsync(fd)
                if owner is not None:
                    os.fchown(fd, *owner)
            finally:
                os.close(fd)
            os.replace(NEW_PREFIX + path.name, path.name, src_dir_fd=ssh_dir, dst_dir_fd=ssh_dir)
        return path

    def remove(self) -> None:
        """No key of the tenant opens the node: the file goes, whatever it holds (on a node
        without the login user there is none)."""
        try:
            path = self.path()
        except KeysNotWritten:
            return
        if not path.parent.exists() and not path.parent.is_symlink():
            return
        _no_links(path.parent)
        with _directory(path.parent) as ssh_dir:
            # unlink takes a link in the file's place itself, never what it points at.
            _unlink(path.name, ssh_dir)
            _unlink(NEW_PREFIX + path.name, ssh_dir)

    def end_sessions(self) -> list[int]:
        """Every process of the login user killed (SIGKILL), its SSH sessions first among them: a
        session open at the release does not outlive it. Only as root, and never for a login
        user that is root itself. Returns the pids killed."""
        owner = self._owner()
        if owner is None or owner[0] == 0:
            return []
        killed = []
        for pid in _processes_of(owner[0]):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        return killed

    def _owner(self) -> tuple[int, int] | None:
        """The user's uid and gid, where the agent may hand the file over (root); None elsewhere."""
        if os.geteuid() != 0:
            return None
        try:
            entry = pwd.getpwnam(self.user)
        except KeyError:
            return None
        return entry.pw_uid, entry.pw_gid


def _no_links(directory: Path) -> None:
    """Refuse a directory that is a symbolic link, or whose parent is (the user's `.ssh` and
    home: what the login user could have replaced)."""
    absolute = Path(os.path.abspath(directory))
    for part in (absolute, absolute.parent):
        if part.is_symlink():
            raise KeysNotWritten(f"{part} is a symbolic link: the agent writes and removes SSH keys only at real paths")


@contextmanager
def _directory(directory: Path) -> Iterator[int]:
    """The directory, opened without following a link in its place (what is checked is what is
    written in, whatever the user swaps in meanwhile)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise KeysNotWritten(f"{directory}: {exc.strerror}: the agent writes SSH keys only in a real directory")
    try:
        yield fd
    finally:
        os.close(fd)


def _unlink(name: str, directory: int) -> None:
    with suppress(FileNotFoundError):
        os.unlink(name, dir_fd=directory)


def _processes_of(uid: int, proc: Path = Path("/proc")) -> list[int]:
    """The pids whose real or effective uid is `uid` (`/proc/<pid>/status`)."""
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:  # gone meanwhile
            continue
        uids = next((line.split()[1:3] for line in status.splitlines() if line.startswith("Uid:")), [])
        if str(uid) in uids:
            pids.append(int(entry.name))
    return pids
