"""The one check that a chunk's bytes are the chunk: they hash (BLAKE3) to its content address.

Every trust boundary runs it: the store on the way in and out (`registry/store.py`), the API
client on a download (`client/registry.py`), the node's cache when it stores, serves or loads a
chunk (`agent/chunk_store.py`, `agent/version_files.py`). `verify_chunk` checks bytes held whole;
`ChunkCheck` checks bytes that pass in pieces (a stream, a file read in a bounded buffer). Both
fail closed: anything but an exact match, a malformed id included, raises
`ChunkDigestMismatchError`, which names the expected and the actual digest.

Hashing that *names* a chunk (cutting a file at push time) lives in `registry/chunking.py`; the
digests of manifests, records and keys in `registry/manifest.py`. No other module hashes chunks:
`tests/weights/test_chunk_integrity.py` holds that rule.
"""

from __future__ import annotations

from gpucloud.registry.chunking import new_hasher
from gpucloud.registry.manifest import ChunkCorruptedError


class ChunkDigestMismatchError(ChunkCorruptedError):
    """The bytes hash to `actual`, not to the chunk id (`expected`) they were offered as."""

    def __init__(
        self, detail: str, *, expected: str, actual: str, path: str | None = None, offset: int | None = None
    ) -> None:
        super().__init__(detail, chunk_id=expected, path=path, offset=offset, actual_id=actual)
        self.expected, self.actual = expected, actual


class ChunkCheck:
    """The check of one chunk's bytes as they pass in pieces: `update` with each, then `verify`.

    `size_hint` is the chunk's size when it is known: a large chunk is hashed on every core. A
    store or a download serving many chunks at once leaves it at 1 (one thread per hash).
    """

    def __init__(self, chunk_id: str, *, size_hint: int = 1) -> None:
        self.chunk_id = chunk_id
        self._hasher = new_hasher(size_hint)

    def update(self, piece: bytes | bytearray | memoryview) -> None:
        self._hasher.update(piece)

    @property
    def actual(self) -> str:
        """What the bytes so far hash to."""
        return self._hasher.hexdigest()

    def verify(self, *, source: str = "bytes", path: str | None = None, offset: int | None = None) -> None:
        """Raise `ChunkDigestMismatchError` unless the bytes so far are the chunk.

        `source` says whose bytes they were, as the start of the error's detail ("<source> hash
        to <actual>"); `path` and `offset` say where in a version, when they were read from one.
        """
        actual = self.actual
        if actual != self.chunk_id:
            raise ChunkDigestMismatchError(
                f"{source} hash to {actual}", expected=self.chunk_id, actual=actual, path=path, offset=offset
            )


def verify_chunk(
    digest: str,
    data: bytes | bytearray | memoryview,
    *,
    source: str = "bytes",
    path: str | None = None,
    offset: int | None = None,
) -> None:
    """Raise `ChunkDigestMismatchError` unless `data` hashes to `digest` (see `ChunkCheck.verify`)."""
    check = ChunkCheck(digest, size_hint=len(data))
    check.update(data)
    check.verify(source=source, path=path, offset=offset)
