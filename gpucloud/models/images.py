"""Container image references as tenants give them: the one grammar both the agent's workloads
(`protocol.actions.Workload.image`) and the registry's evaluation commands
(`models.registry_tables.EvaluationCommand.image`) accept, owned by neither.

It is the OCI distribution reference grammar (`distribution/reference`: an optional registry
host and port, lowercase path components, an optional tag, an optional digest), without IPv6
hosts. A reference that matches it starts with a letter or digit, so no reference can be read
as an option of the container runtime it is handed to.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import StringConstraints

_DOMAIN_COMPONENT = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
_DOMAIN = rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"

IMAGE_REFERENCE_PATTERN = rf"^(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*(?::{_TAG})?(?:@{_DIGEST})?$"

# The whole reference is at most 255 characters, as the distribution spec bounds a name.
ImageReference = Annotated[str, StringConstraints(max_length=255, pattern=IMAGE_REFERENCE_PATTERN)]
