"""The node protocol's workload output: what the control plane asks a node's agent (the real one
or a simulated node) at `GET /workload/logs`, and the bounds both ends hold to. The agent answers
with the workload's stdout and stderr as the program wrote them (`text/plain`), the tenant's own
text: nobody on the way parses it.

A read is bounded in size (`tail`, at most `MAX_TAIL_LINES` lines and `MAX_TAIL_BYTES` bytes) and
a follow in time (`follow_s`, at most `MAX_FOLLOW_S`): it ends when the workload has exited and
all it wrote is handed over, or when its time is up, whichever comes first.

Who may read: the control plane's own token for the node (`agent:<node>`, as for actions), or a
token for the node's output alone (`agent-logs:<node>`, role `log-reader`): the one the API mints
with its delegate, which can mint nothing that acts on a node.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

WORKLOAD_LOGS_PATH = "/workload/logs"
MAX_TAIL_LINES = 10_000
MAX_TAIL_BYTES = 1024 * 1024
MAX_FOLLOW_S = 600.0
DEFAULT_FOLLOW_S = 300.0
# What one follow hands over at most, however fast the workload prints.
MAX_FOLLOW_BYTES = 64 * 1024 * 1024


class LogsQuery(BaseModel):
    """`GET /workload/logs`'s query: the last `tail` lines (None: as many as the bytes bound
    allows), then with `follow` what comes, for `follow_s` at most."""

    tail: int | None = Field(None, ge=0, le=MAX_TAIL_LINES)
    follow: bool = False
    follow_s: float = Field(DEFAULT_FOLLOW_S, gt=0, le=MAX_FOLLOW_S)

    def params(self) -> dict[str, str]:
        """As query parameters (what the control plane's client sends)."""
        query = {"follow": "true" if self.follow else "false", "follow_s": f"{self.follow_s:g}"}
        return query | ({"tail": str(self.tail)} if self.tail is not None else {})
