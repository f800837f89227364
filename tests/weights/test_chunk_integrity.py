"""The one chunk check (`gpucloud.registry.integrity`), and the rule that nothing else hashes chunks.

The rule, read from the source with `ast` over every module of the package:
- `blake3` is imported only where a digest is *made*: `registry/chunking.py` (naming the chunks a
  push cuts) and `registry/manifest.py` (the digests of manifests, records and keys).
- `new_hasher` (chunking's BLAKE3 hasher) is used only there and in `registry/integrity.py`, so
  every comparison of bytes against a chunk id goes through `verify_chunk` / `ChunkCheck`.
- `digest_bytes` (manifest's BLAKE3 of bytes) is used only inside `registry/manifest.py`.
- Only `registry/integrity.py` builds a chunk error from a fresh hash (`ChunkCorruptedError` or
  `ChunkDigestMismatchError` given `actual_id=` / `actual=`); others may re-raise and reclassify.
"""

from __future__ import annotations

import ast
from pathlib import Path

import blake3
import pytest

from gpucloud.registry.integrity import ChunkCheck, ChunkDigestMismatchError, verify_chunk
from gpucloud.registry.manifest import ChunkCorruptedError, IntegrityError

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "gpucloud"
DATA = bytes(range(256)) * 64
DIGEST = blake3.blake3(DATA).hexdigest()

BLAKE3_IMPORTERS = {"registry/chunking.py", "registry/manifest.py"}
HASHER_USERS = {"registry/chunking.py", "registry/integrity.py"}
DIGEST_BYTES_USERS = {"registry/manifest.py"}
MISMATCH_BUILDERS = {"registry/integrity.py"}


def test_matching_bytes_pass() -> None:
    verify_chunk(DIGEST, DATA)
    verify_chunk(DIGEST, memoryview(DATA))
    verify_chunk(DIGEST, bytearray(DATA))


@pytest.mark.parametrize(
    ("digest", "data"),
    [
        (DIGEST, DATA[:-1]),  # truncated
        (DIGEST, DATA + b"\0"),  # extended
        (DIGEST, bytes([DATA[0] ^ 1]) + DATA[1:]),  # one bit flipped
        (DIGEST, b""),
        (DIGEST.upper(), DATA),  # not a well-formed id: fails closed, never normalised
        ("", DATA),
        (DIGEST[:-1], DATA),
    ],
)
def test_anything_else_raises_one_typed_error(digest: str, data: bytes) -> None:
    with pytest.raises(ChunkDigestMismatchError) as caught:
        verify_chunk(digest, data)
    error = caught.value
    actual = blake3.blake3(data).hexdigest()
    assert (error.expected, error.actual) == (digest, actual)
    assert (error.chunk_id, error.actual_id) == (digest, actual)  # what existing handlers read
    assert isinstance(error, ChunkCorruptedError) and isinstance(error, IntegrityError)
    assert digest in str(error) and actual in str(error)


def test_the_error_says_whose_bytes_and_where() -> None:
    with pytest.raises(ChunkDigestMismatchError) as caught:
        verify_chunk(DIGEST, b"x", source="bytes on disk", path="model.safetensors", offset=64)
    message = str(caught.value)
    assert "bytes on disk hash to" in message and "'model.safetensors' at offset 64" in message
    assert (caught.value.path, caught.value.offset) == ("model.safetensors", 64)


@pytest.mark.parametrize("size_hint", [1, len(DATA), 64 << 20])
def test_check_in_pieces_matches_whole(size_hint: int) -> None:
    check = ChunkCheck(DIGEST, size_hint=size_hint)
    for start in range(0, len(DATA), 1000):
        check.update(DATA[start : start + 1000])
    assert check.actual == DIGEST
    check.verify()
    check.update(b"more")
    with pytest.raises(ChunkDigestMismatchError):
        check.verify()


def test_check_with_no_bytes_fails() -> None:
    with pytest.raises(ChunkDigestMismatchError):
        ChunkCheck(DIGEST).verify()


def _modules() -> list[tuple[str, ast.Module]]:
    return [(path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())) for path in PACKAGE.rglob("*.py")]


def _imports_blake3(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "blake3" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "blake3":
            return True
    return False


def _uses_name(tree: ast.Module, name: str) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == name:
            return True
        if isinstance(node, ast.Attribute) and node.attr == name:
            return True
        if isinstance(node, ast.alias) and name in (node.name, node.name.rsplit(".", 1)[-1]):
            return True
    return False


def _builds_mismatch(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        keywords = {k.arg for k in node.keywords}
        if called in ("ChunkCorruptedError", "ChunkDigestMismatchError") and keywords & {"actual_id", "actual"}:
            return True
    return False


def test_only_the_chunk_check_hashes_chunks() -> None:
    modules = _modules()
    assert len(modules) > 100  # the walk found the package
    assert {name for name, tree in modules if _imports_blake3(tree)} <= BLAKE3_IMPORTERS
    assert {name for name, tree in modules if _uses_name(tree, "new_hasher")} == HASHER_USERS
    assert {name for name, tree in modules if _uses_name(tree, "digest_bytes")} == DIGEST_BYTES_USERS
    assert {name for name, tree in modules if _builds_mismatch(tree)} == MISMATCH_BUILDERS


def test_the_rule_sees_what_it_forbids() -> None:
    smuggled = ast.parse(
        "import blake3\n"
        "from gpucloud.registry.chunking import new_hasher\n"
        "if blake3.blake3(data).hexdigest() != chunk_id:\n"
        "    raise ChunkCorruptedError('bad', chunk_id=chunk_id, actual_id=x)\n"
    )
    assert _imports_blake3(smuggled) and _uses_name(smuggled, "new_hasher") and _builds_mismatch(smuggled)
    assert _uses_name(ast.parse("from gpucloud.registry import manifest\nmanifest.digest_bytes(b'')"), "digest_bytes")
