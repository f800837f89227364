"""Pull retries a broken chunk transfer with backoff, re-fetches a mismatch once, then fails closed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from botocore.stub import Stubber

from gpucloud.registry.chunking import ChunkPolicy
from gpucloud.registry.manifest import (
    ChunkCorruptedError,
    ChunkTransferError,
    ChunkUnavailableError,
    Keyring,
    Signer,
)
from gpucloud.registry.pull import ChunkRetry, pull
from gpucloud.registry.push import StoreTarget, push
from gpucloud.registry.store import LocalChunkStore, LocalManifestStore, S3ChunkStore

pytestmark = pytest.mark.unit

POLICY = ChunkPolicy(max_chunk_size=2048, pack_size=512, fixed_chunk_size=2048, read_size=1024)


class FlakyStore(LocalChunkStore):
    """Breaks the first `failures` reads of `victim` the way `how` says."""

    def __init__(self, root: Path, *, victim: str, failures: int, how: str) -> None:
        super().__init__(root, read_size=500)
        self.victim, self.failures, self.how = victim, failures, how
        self.reads = 0

    def stream(self, chunk_id: str) -> Iterator[bytes]:
        if chunk_id != self.victim:
            return super().stream(chunk_id)
        self.reads += 1
        if self.reads > self.failures:
            return super().stream(chunk_id)
        if self.how == "5xx":
            raise ChunkTransferError("store answered 503", chunk_id=chunk_id)
        return self._broken(super().stream(chunk_id))

    def _broken(self, pieces: Iterator[bytes]) -> Iterator[bytes]:
        yield next(pieces)  # some bytes land before the break
        if self.how == "reset":
            raise ConnectionResetError("connection reset by peer")
        raise ChunkTransferError("body cut off after 500 bytes", chunk_id=self.victim)


class Setup:
    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "reg"
        self.signer, self.keyring = Signer.generate(), Keyring()
        self.keyring.trust("acme", self.signer.verify_key)
        self.manifests = LocalManifestStore(self.root)
        source = tmp_path / "src"
        source.mkdir()
        (source / "weights.bin").write_bytes(os.urandom(7000))
        self.digest = push(
            source,
            model="m",
            target=StoreTarget(LocalChunkStore(self.root), self.manifests, settle_seconds=0),
            signer=self.signer,
            policy=POLICY,
        ).digest
        self.victim = self.manifests.get(self.digest).manifest.files["weights.bin"].chunks[1]
        self.source = source
        self.sleeps: list[float] = []

    def pull(self, store: LocalChunkStore, dest: Path, **retry):
        policy = ChunkRetry(sleep=self.sleeps.append, **retry)
        return pull(
            self.digest,
            dest,
            chunk_store=store,
            manifest_store=self.manifests,
            keyring=self.keyring,
            tenant="acme",
            retry=policy,
            concurrency=1,
        )


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    return Setup(tmp_path)


@pytest.mark.parametrize("how", ["reset", "cut-off", "5xx"])
def test_a_broken_transfer_is_retried_with_backoff_and_the_pull_succeeds(
    setup: Setup, tmp_path: Path, how: str
) -> None:
    store = FlakyStore(setup.root, victim=setup.victim.id, failures=3, how=how)
    result = setup.pull(store, tmp_path / "out", attempts=4, first_delay=0.1)
    assert (result.path / "weights.bin").read_bytes() == (setup.source / "weights.bin").read_bytes()
    assert store.reads == 4
    assert setup.sleeps == [0.1, 0.2, 0.4]


def test_a_transfer_that_keeps_breaking_fails_closed_naming_the_chunk(setup: Setup, tmp_path: Path) -> None:
    store = FlakyStore(setup.root, victim=setup.victim.id, failures=100, how="reset")
    dest = tmp_path / "out" / "v1"
    with pytest.raises(ChunkUnavailableError) as caught:
        setup.pull(store, dest, attempts=3, first_delay=1.0, max_delay=1.5)
    message = str(caught.value)
    assert setup.victim.id in message and "weights.bin" in message and f"offset {setup.victim.offset}" in message
    assert "3 times" in message and "ConnectionResetError" in message
    assert store.reads == 3 and setup.sleeps == [1.0, 1.5]
    assert not dest.exists() and list(dest.parent.iterdir()) == []


def test_a_corrupt_chunk_is_fetched_again_once_then_refused(setup: Setup, tmp_path: Path) -> None:
    store = FlakyStore(setup.root, victim=setup.victim.id, failures=0, how="reset")
    path = store.path(setup.victim.id)
    data = bytearray(path.read_bytes())
    data[3] ^= 1
    path.write_bytes(bytes(data))
    dest = tmp_path / "out"
    with pytest.raises(ChunkCorruptedError, match=setup.victim.id):
        setup.pull(store, dest, attempts=10)
    assert store.reads == 2  # one re-fetch, not one per transfer attempt
    assert setup.sleeps == [] and not dest.exists()


def test_a_mismatch_that_heals_on_the_refetch_is_accepted(setup: Setup, tmp_path: Path) -> None:
    class FlipsOnce(LocalChunkStore):
        reads = 0

        def stream(self, chunk_id: str) -> Iterator[bytes]:
            pieces = super().stream(chunk_id)
            if chunk_id != setup.victim.id:
                return pieces
            FlipsOnce.reads += 1
            if FlipsOnce.reads > 1:
                return pieces
            raise ChunkCorruptedError("bit flipped in flight", chunk_id=chunk_id, actual_id="0" * 64)

    result = setup.pull(FlipsOnce(setup.root), tmp_path / "out")
    assert (result.path / "weights.bin").read_bytes() == (setup.source / "weights.bin").read_bytes()
    assert FlipsOnce.reads == 2


def test_s3_server_errors_and_cut_bodies_are_transfer_errors() -> None:
    import boto3

    client = boto3.client("s3", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    store = S3ChunkStore(client, "bucket")
    chunk_id = "ab" * 32
    with Stubber(client) as stub:
        stub.add_client_error("get_object", service_error_code="InternalError", http_status_code=500)
        with pytest.raises(ChunkTransferError, match=chunk_id):
            store.stream(chunk_id)
        stub.add_client_error("get_object", service_error_code="AccessDenied", http_status_code=403)
        with pytest.raises(client.exceptions.ClientError):  # not transient: no retry
            store.stream(chunk_id)


def test_an_s3_body_cut_off_midway_is_a_transfer_error() -> None:
    from botocore.exceptions import ClientError as BotoClientError
    from botocore.exceptions import ResponseStreamingError

    class CutBody:
        def __enter__(self):
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def iter_chunks(self, size: int) -> Iterator[bytes]:
            yield b"x" * 10
            raise ResponseStreamingError(error="Connection broken: IncompleteRead(10 bytes read)")

    class Client:
        class exceptions:
            ClientError = BotoClientError

        def get_object(self, **kwargs: object) -> dict:
            return {"Body": CutBody()}

    chunk_id = "cd" * 32
    with pytest.raises(ChunkTransferError, match="cut off"):
        list(S3ChunkStore(Client(), "bucket").stream(chunk_id))


def test_each_kind_of_failure_spends_its_own_budget(setup: Setup, tmp_path: Path) -> None:
    """A break, a mismatch and two more breaks: the mismatch takes nothing from the transfer's
    tries, and the backoff counts only the breaks."""

    class Mixed(LocalChunkStore):
        reads = 0

        def stream(self, chunk_id: str) -> Iterator[bytes]:
            pieces = super().stream(chunk_id)
            if chunk_id != setup.victim.id:
                return pieces
            Mixed.reads += 1
            if Mixed.reads == 2:
                raise ChunkCorruptedError("bit flipped in flight", chunk_id=chunk_id, actual_id="0" * 64)
            if Mixed.reads in (1, 3, 4):
                raise ChunkTransferError("store answered 503", chunk_id=chunk_id)
            return pieces

    result = setup.pull(Mixed(setup.root), tmp_path / "out", attempts=4, first_delay=0.1)
    assert (result.path / "weights.bin").read_bytes() == (setup.source / "weights.bin").read_bytes()
    assert Mixed.reads == 5
    assert setup.sleeps == [0.1, 0.2, 0.4]  # after breaks 1, 2 and 3; none after the mismatch
