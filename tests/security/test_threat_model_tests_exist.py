"""Every test docs/security.md names as a row's proof exists: a renamed or deleted test would
leave a defence with no test that fails without it, and the table would not say so."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_the_threat_model_names_exists() -> None:
    text = (ROOT / "docs" / "security.md").read_text()
    missing = []
    for cell in re.findall(r"`(tests/[^`]+)`", text):
        path, _, name = cell.partition("::")
        if path.endswith("/") and (ROOT / path).is_dir():  # a folder of tests
            continue
        if not (ROOT / path).is_file():
            missing.append(path)
            continue
        source = (ROOT / path).read_text()
        if name and not re.search(rf"def {re.escape(name)}\b", source):
            missing.append(cell)
    # A row's "`::test_other`" cells name more tests of the file before them.
    for path, rest in re.findall(r"`(tests/[^`:]+\.py)::[^`]+`((?:, `::[^`]+`)+)", text):
        source = (ROOT / path).read_text()
        for name in re.findall(r"`::([^`]+)`", rest):
            if not re.search(rf"def {re.escape(name)}\b", source):
                missing.append(f"{path}::{name}")
    assert missing == []
