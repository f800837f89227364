"""The registry's words on the wire, importable without its tables (the CLI imports these, and
importing SQLModel's tables would add a quarter of a second to every command).

They sit with the models (floor 0) because the registry's messages and tables use them as
much as the registry does; `gpucloud.registry` imports them from here."""

from __future__ import annotations

import re
from enum import StrEnum


class AliasName(StrEnum):
    CANDIDATE = "candidate"
    STAGING = "staging"
    PRODUCTION = "production"


GATED_ALIASES = frozenset({AliasName.STAGING, AliasName.PRODUCTION})


# ---------------------------------------------------------------- version refs
#
# The one way the project reads a name for a version, wherever one is given (the registry's
# routes, `gpucloud weights`, a rollout's `model_version`): `MODEL@REF`, where REF is an alias,
# a full digest or a unique digest prefix; a rollout also takes a bare full digest.

# A BLAKE3 hex digest, as a pydantic pattern: a chunk id, a version (manifest) digest, a key id.
HEX_DIGEST = r"^[0-9a-f]{64}$"

MIN_DIGEST_PREFIX = 8
_DIGEST = re.compile(r"[0-9a-f]{64}")
_PREFIX = re.compile(rf"[0-9a-f]{{{MIN_DIGEST_PREFIX},63}}")


class RefKind(StrEnum):
    ALIAS = "alias"
    DIGEST = "digest"
    PREFIX = "prefix"


def ref_kind(ref: str) -> RefKind:
    """What REF names; ValueError (saying what would do) for anything else."""
    if ref in {a.value for a in AliasName}:
        return RefKind.ALIAS
    if _DIGEST.fullmatch(ref):
        return RefKind.DIGEST
    if _PREFIX.fullmatch(ref):
        return RefKind.PREFIX
    raise ValueError(
        f"{ref!r} is not a digest, a digest prefix of at least {MIN_DIGEST_PREFIX} hex digits, or an alias "
        f"({', '.join(a.value for a in AliasName)})"
    )


def split_ref(text: str) -> tuple[str | None, str]:
    """`MODEL@REF` as (model, ref), checking REF's form; a bare full digest as (None, digest).
    ValueError naming the accepted forms for anything else."""
    model, sep, ref = text.partition("@")
    if not sep:
        if _DIGEST.fullmatch(text):
            return None, text
        raise ValueError(f"{text!r} is not MODEL@ALIAS, MODEL@DIGEST (or a unique prefix of it), or a full digest")
    if not model or not ref or "@" in ref:
        raise ValueError(f"{text!r} is not MODEL@ALIAS or MODEL@DIGEST (or a unique prefix of it)")
    ref_kind(ref)
    return model, ref


class EvaluatorName(StrEnum):
    """The evaluators the platform runs: `sanity` (the built-in weight-sanity evaluator,
    `gpucloud.registry.sanity`) and `command` (the model's own evaluation command)."""

    SANITY = "sanity"
    COMMAND = "command"


# The most chunk ids one question to the registry may name (`POST .../chunks:missing`); a client
# asks about more in batches of this many.
MAX_IDS_PER_QUERY = 10_000
