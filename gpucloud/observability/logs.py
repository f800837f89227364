"""Logging for every gpucloud process: text for people, or one JSON object per line for
machines (`GPUCLOUD_TELEMETRY__LOG_FORMAT=json`), each carrying the ids of what it is about.

The ids come from, in order: the log call's own `extra` (`log.info("...", extra={"node_id": n})`),
the context of the request or step being served (`log_context(tenant_id=...)`, which the API sets
from the caller, and which follows the request into threads), and, inside a Temporal activity or
workflow, the workflow it belongs to (its id names the allocation, node, rollout or tenant:
`alloc-<id>`, `node-<id>`, `rollout-<id>`, ...). Secrets never reach a log line: settings hold them
as `SecretStr`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from gpucloud.models.workflow_ids import ALLOCATION_WORKFLOW_PREFIX, NODE_WORKFLOW_PREFIX, ROLLOUT_WORKFLOW_PREFIX

IDS = ("tenant_id", "allocation_id", "node_id", "operation_id", "rollout_id", "workflow_id", "activity")
_CONTEXT: ContextVar[dict[str, str]] = ContextVar("gpucloud_log_context", default={})  # noqa: B039 - never mutated
# What a workflow id's prefix says it is about (`models/workflow_ids.py` mints them: alloc-<id>, ...).
_WORKFLOW_PREFIXES = (
    (ALLOCATION_WORKFLOW_PREFIX, "allocation_id"),
    (NODE_WORKFLOW_PREFIX, "node_id"),
    (ROLLOUT_WORKFLOW_PREFIX, "rollout_id"),
)


@contextmanager
def log_context(**ids: str | None) -> Iterator[None]:
    """Every line logged inside carries these ids (those given a value)."""
    token = _CONTEXT.set({**_CONTEXT.get(), **{k: v for k, v in ids.items() if v}})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def _temporal_ids() -> dict[str, str]:
    try:
        from temporalio import activity, workflow
    except ImportError:  # pragma: no cover - temporalio is a dependency
        return {}
    if activity.in_activity():
        info = activity.info()
        workflow_id, ids = info.workflow_id or "", {"activity": info.activity_type}
    elif workflow.in_workflow():
        workflow_id, ids = workflow.info().workflow_id, {}
    else:
        return {}
    ids["workflow_id"] = workflow_id
    for prefix, name in _WORKFLOW_PREFIXES:
        if workflow_id.startswith(prefix):
            ids[name] = workflow_id.removeprefix(prefix)
    return ids


def ids_of(record: logging.LogRecord) -> dict[str, str]:
    found = {**_temporal_ids(), **_CONTEXT.get()}
    for name in IDS:
        value = record.__dict__.get(name)
        if value:
            found[name] = str(value)
    return found


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the ids, and the error if any."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **ids_of(record),
        }
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """The classic line, with the ids in brackets when there are any."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        ids = ids_of(record)
        return f"{text} [{' '.join(f'{k}={v}' for k, v in ids.items())}]" if ids else text


def configure(*, level: str = "INFO", fmt: str = "text") -> None:
    """Log to stderr at `level`, as `fmt` (`text` or `json`), replacing any earlier set-up."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per agent call is noise
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []  # through the root handler, in the same format
        logging.getLogger(name).propagate = True
