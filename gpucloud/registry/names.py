"""The registry's words on the wire, importable without its tables (the CLI imports these, and
importing SQLModel's tables would add a quarter of a second to every command)."""

from __future__ import annotations

from enum import StrEnum


class AliasName(StrEnum):
    CANDIDATE = "candidate"
    STAGING = "staging"
    PRODUCTION = "production"


GATED_ALIASES = frozenset({AliasName.STAGING, AliasName.PRODUCTION})


class EvaluatorName(StrEnum):
    """The evaluators the platform runs: `sanity` (the built-in weight-sanity evaluator,
    `gpucloud.registry.sanity`) and `command` (the model's own evaluation command)."""

    SANITY = "sanity"
    COMMAND = "command"


# The most chunk ids one question to the registry may name (`POST .../chunks:missing`); a client
# asks about more in batches of this many.
MAX_IDS_PER_QUERY = 10_000
