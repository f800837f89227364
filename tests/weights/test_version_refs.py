"""The one reading of a version's name (`models.registry_names.split_ref`), which the registry's routes,
`gpucloud weights` and a rollout's `model_version` share."""

from __future__ import annotations

import re

import pytest

from gpucloud.models.registry_names import RefKind, ref_kind, split_ref

pytestmark = pytest.mark.unit

DIGEST = "ab" * 32


@pytest.mark.parametrize(
    ("text", "model", "ref", "kind"),
    [
        ("minilm@production", "minilm", "production", RefKind.ALIAS),
        (f"minilm@{DIGEST}", "minilm", DIGEST, RefKind.DIGEST),
        (f"minilm@{DIGEST[:8]}", "minilm", DIGEST[:8], RefKind.PREFIX),
        (DIGEST, None, DIGEST, RefKind.DIGEST),
    ],
)
def test_a_ref_names_a_model_and_an_alias_digest_or_prefix(text, model, ref, kind) -> None:
    assert split_ref(text) == (model, ref)
    assert ref_kind(ref) == kind


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("minilm", "MODEL@ALIAS"),  # a bare name is not a version
        (DIGEST[:12], "MODEL@ALIAS"),  # a bare prefix needs its model
        ("minilm@", "MODEL@ALIAS"),
        ("@production", "MODEL@ALIAS"),
        ("minilm@prod", "an alias (candidate, staging, production)"),
        (f"minilm@{DIGEST[:7]}", "at least 8 hex digits"),
        (f"minilm@{DIGEST.upper()}", "not a digest"),
        ("a@b@production", "MODEL@ALIAS"),
    ],
)
def test_anything_else_is_refused_saying_what_would_do(text, says) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        split_ref(text)
