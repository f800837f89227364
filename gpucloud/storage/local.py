"""The object store as a local directory: the embedded default (`<data dir>/objects`).

An object is a file at `<root>/<key>`. A write goes to a temporary file in `<root>/tmp`, is
fsynced, renamed into place and its directory fsynced (and any directory it created), so an
object is either whole and durable or absent, across a crash too. Whole blocks are written and
read with direct I/O where the file system allows it (`storage/direct.py`): gigabytes of weights
pass through without filling the page cache. Objects are tenants' weights
and data: files are 0600 and folders 0700, readable only by the user the control plane runs as. Presigned URLs are
`<base_url>/<key>?method&expires&signature`, signed with HMAC-SHA256 and checked by
`resolve_presigned`, which whatever serves the directory to nodes calls first.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

from gpucloud.storage.direct import direct_pieces, write_durably
from gpucloud.storage.objects import (
    PRESIGN_METHODS,
    ObjectInfo,
    ObjectMissingError,
    ObjectStore,
    PresignedUrlError,
    StoreMissingError,
)

TMP = "tmp"


def fsync_path(path: str | Path) -> None:
    """Flush a file, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalObjectStore(ObjectStore):
    def __init__(self, root: str | Path, *, signing_key: bytes = b"", base_url: str = "local://objects") -> None:
        self.root = Path(root).resolve()
        self._tmp = self.root / TMP
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._tmp.mkdir(mode=0o700, exist_ok=True)
        self._signing_key = signing_key
        self._base_url = base_url.rstrip("/")

    def path(self, key: str) -> Path:
        # Checked by its segments, not resolved on disk: a resolve costs a system call per folder
        # on every read, write and existence check, and nothing but the store writes in its root.
        parts = [part for part in key.split("/") if part not in ("", ".")]
        if not parts or key.startswith("/") or ".." in parts or "\0" in key or parts[0] == TMP:
            raise ValueError(f"key {key!r} leaves the store's objects")
        return self.root.joinpath(*parts)

    def put_stream(
        self, key: str, pieces: Iterable[bytes | memoryview], *, check: Callable[[], None] | None = None
    ) -> None:
        path = self.path(key)
        fd, tmp_name = tempfile.mkstemp(dir=self._tmp, prefix=f"{path.name[:16]}.")
        try:
            write_durably(fd, tmp_name, pieces, check=check)  # whole blocks past the page cache
            created = self._make_parents(path.parent)
            os.replace(tmp_name, path)
            for directory in (path.parent, *created):
                fsync_path(directory)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise

    def _make_parents(self, directory: Path) -> list[Path]:
        """Create `directory` and its missing parents; the parents of every one created, whose
        entries must be made durable too."""
        missing = []
        while not directory.is_dir():
            missing.append(directory)
            directory = directory.parent
        directory_of_new = []
        for new in reversed(missing):
            new.mkdir(mode=0o700, exist_ok=True)
            directory_of_new.append(new.parent)
        return directory_of_new

    def read_stream(self, key: str, *, piece_size: int) -> Iterator[bytes]:
        try:
            direct = direct_pieces(self.path(key))
        except FileNotFoundError:
            raise ObjectMissingError(key) from None
        if direct is not None:  # pieces of up to `direct.STAGE`, whatever `piece_size` asks
            return direct
        try:
            f = open(self.path(key), "rb", buffering=0)  # noqa: SIM115 - closed by the generator
        except FileNotFoundError:
            raise ObjectMissingError(key) from None

        def pieces() -> Iterator[bytes]:
            with f:
                while piece := f.read(piece_size):
                    yield piece

        return pieces()

    def get(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectMissingError(key) from None

    def stat(self, key: str) -> ObjectInfo:
        try:
            st = self.path(key).stat()
        except FileNotFoundError:
            raise ObjectMissingError(key) from None
        return ObjectInfo(key, st.st_size, datetime.fromtimestamp(st.st_mtime, UTC))

    def scan(self, prefix: str) -> Iterator[ObjectInfo]:
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not base.is_dir():
            return
        for directory, dirs, files in os.walk(base):
            here = Path(directory)
            dirs[:] = sorted(d for d in dirs if here / d != self._tmp)
            for name in sorted(files):
                key = (here / name).relative_to(self.root).as_posix()
                if not key.startswith(prefix):
                    continue
                try:
                    st = (here / name).stat()
                except FileNotFoundError:  # deleted while we listed
                    continue
                yield ObjectInfo(key, st.st_size, datetime.fromtimestamp(st.st_mtime, UTC))

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def uri(self, key: str) -> str:
        return self.path(key).as_uri()

    def abort_incomplete(self, *, prefix: str, older_than: datetime) -> int:
        # Temporary files are named by the object, not its prefix: any abandoned one is garbage.
        removed = 0
        for entry in os.scandir(self._tmp):
            if datetime.fromtimestamp(entry.stat().st_mtime, UTC) < older_than:
                Path(entry.path).unlink(missing_ok=True)
                removed += 1
        return removed

    def probe(self) -> None:
        # The directory is made when the store opens; one removed since leaves every write failing.
        if not self._tmp.is_dir():
            raise StoreMissingError(f"the object store's directory {self.root}", "no such directory")

    def _signature(self, method: str, key: str, expires: int) -> str:
        message = f"{method}\n{key}\n{expires}".encode()
        return hmac.new(self._signing_key, message, hashlib.sha256).hexdigest()

    def presign(self, key: str, *, method: str, expires_s: int) -> str:
        if method not in PRESIGN_METHODS:
            raise ValueError(f"cannot presign {method}; only {sorted(PRESIGN_METHODS)}")
        if not self._signing_key:
            raise ValueError("this store was opened without a signing key: it cannot presign")
        expires = int(time.time()) + expires_s
        signature = self._signature(method, key, expires)
        return f"{self._base_url}/{quote(key)}?method={method}&expires={expires}&signature={signature}"

    def resolve_presigned(self, url: str, *, method: str, now: float | None = None) -> str:
        """The key a presigned URL grants `method` on; raises `PresignedUrlError` otherwise."""
        parts = urlsplit(url)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        key = unquote(url[len(self._base_url) + 1 :].split("?", 1)[0])
        try:
            expires = int(query["expires"])
            valid = (
                bool(self._signing_key)
                and query["method"] == method
                and hmac.compare_digest(query["signature"], self._signature(method, key, expires))
            )
        except (KeyError, ValueError):
            valid = False
        if not url.startswith(self._base_url + "/") or not valid:
            raise PresignedUrlError(f"the URL does not grant {method} on {key!r}")
        if (time.time() if now is None else now) > expires:
            raise PresignedUrlError(f"the URL for {key!r} expired")
        return key
