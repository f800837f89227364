"""The runnable blocks of a guide: a fenced block right after `<!-- step: NAME -->` is step NAME,
read as the guide shows it, so a test runs what the reader is told to run."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

_STEP = re.compile(r"<!-- step: ([\w-]+) -->\s*\n```(\w*)\n(.*?)\n```", re.DOTALL)


@dataclass(frozen=True)
class Step:
    name: str
    lang: str
    text: str

    def commands(self, replacements: dict[str, str] | None = None) -> list[list[str]]:
        """The block's command lines, split as a shell would (comments dropped), with each
        `replacements` key (a URL, a path of the guide's hosts) replaced by the test's own."""
        lines = []
        for line in self.substituted(replacements).splitlines():
            words = shlex.split(line, comments=True)
            if words:
                lines.append(words)
        return lines

    def substituted(self, replacements: dict[str, str] | None = None) -> str:
        text = self.text
        for old, new in (replacements or {}).items():
            text = text.replace(old, new)
        return text


def steps(path: Path) -> dict[str, Step]:
    found = {m.group(1): Step(m.group(1), m.group(2), m.group(3)) for m in _STEP.finditer(path.read_text())}
    if not found:
        raise ValueError(f"{path} marks no steps (`<!-- step: NAME -->` before a fenced block)")
    return found
