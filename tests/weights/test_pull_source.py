"""`RegistryPullSource.stream`: what the API's answers to a chunk download become for `pull`:
404 missing, 429 and 5xx a transfer worth another try, other 4xx raised as they are, a cut
connection a transfer error carrying what the bytes received hashed to."""

from __future__ import annotations

import http.client

import blake3
import pytest

from gpucloud.client.base import ApiError
from gpucloud.client.registry import RegistryPullSource
from gpucloud.registry.manifest import ChunkCorruptedError, ChunkMissingError, ChunkTransferError

pytestmark = pytest.mark.unit

DATA = b"weights" * 1000
CHUNK = blake3.blake3(DATA).hexdigest()


class _Client:
    """Serves one outcome for every chunk body: bytes in two pieces, or an exception after `cut` bytes."""

    def __init__(self, *, error: BaseException | None = None, cut: int | None = None, data: bytes = DATA) -> None:
        self.error, self.cut, self.data = error, cut, data

    def chunk_pieces(self, model: str, chunk_id: str):
        if self.error is not None and self.cut is None:
            raise self.error
        sent = self.data if self.cut is None else self.data[: self.cut]
        half = len(sent) // 2
        yield memoryview(bytearray(sent[:half]))
        yield memoryview(bytearray(sent[half:]))
        if self.error is not None:
            raise self.error


def stream(client: _Client, chunk_id: str = CHUNK) -> bytes:
    source = RegistryPullSource(client, "llama")  # type: ignore[arg-type]
    return b"".join(bytes(piece) for piece in source.stream(chunk_id))


def problem(status: int) -> ApiError:
    return ApiError(status, {"type": "https://gpucloud.dev/problems/x", "title": "T", "detail": "d"})


def test_whole_bytes_that_hash_to_the_id_pass_and_are_counted():
    source = RegistryPullSource(_Client(), "llama")  # type: ignore[arg-type]
    assert b"".join(bytes(p) for p in source.stream(CHUNK)) == DATA
    assert source.chunks_done == 1


def test_a_404_is_a_missing_chunk():
    with pytest.raises(ChunkMissingError):
        stream(_Client(error=problem(404)))


@pytest.mark.parametrize("status", [429, 500, 503])
def test_busy_or_failing_api_is_a_transfer_worth_retrying(status: int):
    with pytest.raises(ChunkTransferError, match=str(status)):
        stream(_Client(error=problem(status)))


def test_another_4xx_is_raised_as_the_api_said_it():
    with pytest.raises(ApiError) as caught:
        stream(_Client(error=problem(403)))
    assert caught.value.status == 403


def test_a_cut_connection_reports_what_the_received_bytes_hash_to():
    with pytest.raises(ChunkTransferError) as caught:
        stream(_Client(error=http.client.IncompleteRead(b"", 10), cut=100))
    assert caught.value.actual_id == blake3.blake3(DATA[:100]).hexdigest()


def test_bytes_that_hash_elsewhere_are_corrupted():
    with pytest.raises(ChunkCorruptedError) as caught:
        stream(_Client(data=DATA[::-1]))
    assert caught.value.actual_id == blake3.blake3(DATA[::-1]).hexdigest()
