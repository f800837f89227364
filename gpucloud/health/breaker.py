"""The quarantine circuit breaker: automatic pulls stop when too much of a pool goes at once.

Health rules judge one node at a time. When many nodes of one pool look broken within minutes,
the likelier cause is shared (a bad driver rollout, a fabric switch, a cooling loop, a bug in
the rules themselves), and pulling every node would turn a partial outage into a total one.
So each automatic quarantine asks the breaker first. If the pool's share of nodes pulled
within `window`, counting this one, would exceed `max_pulled_share`, the breaker refuses and
returns an `OperatorAlert`: a person decides.

The breaker closes again on its own as earlier pulls age out of the window, so it limits the
rate of automatic pulls rather than stopping them for good; `reset()` is the operator saying
"these pulls were right, carry on", and forgets the pool's window. `min_pulls_allowed` keeps
small pools usable: a four-node pool may still lose its one broken node.

Pure: time is passed in. The state is a pydantic model so a long-running workflow can carry it
through continue-as-new.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from pydantic import AwareDatetime, BaseModel, ConfigDict


class Pull(BaseModel):
    model_config = ConfigDict(frozen=True)

    node_id: str
    at: AwareDatetime


class BreakerState(BaseModel):
    pulls: dict[str, list[Pull]] = {}


class OperatorAlert(BaseModel):
    model_config = ConfigDict(frozen=True)

    pool: str
    node_id: str
    pulled_in_window: int
    pool_size: int
    max_pulled_share: float
    window: timedelta
    at: AwareDatetime
    reason: str


class QuarantineDecision(BaseModel):
    model_config = ConfigDict(frozen=True)

    allowed: bool
    alert: OperatorAlert | None = None


class CircuitBreaker:
    def __init__(
        self,
        *,
        max_pulled_share: float = 0.05,
        window: timedelta = timedelta(hours=1),
        min_pulls_allowed: int = 1,
        state: BreakerState | None = None,
    ):
        if not 0 < max_pulled_share <= 1:
            raise ValueError("max_pulled_share must be in (0, 1]")
        if window <= timedelta(0):
            raise ValueError("window must be positive")
        self.max_pulled_share = max_pulled_share
        self.window = window
        self.min_pulls_allowed = min_pulls_allowed
        self.state = state or BreakerState()

    def _recent(self, pool: str, now: datetime) -> list[Pull]:
        recent = [p for p in self.state.pulls.get(pool, []) if now - p.at < self.window]
        self.state.pulls[pool] = recent
        return recent

    def _limit(self, pool_size: int) -> int:
        return max(self.min_pulls_allowed, int(self.max_pulled_share * pool_size))

    def pulled_in_window(self, *, pool: str, now: datetime) -> int:
        return len(self._recent(pool, now))

    def is_open(self, *, pool: str, pool_size: int, now: datetime) -> bool:
        """Whether the next new pull from this pool would be refused."""
        return len(self._recent(pool, now)) + 1 > self._limit(pool_size)

    def request_quarantine(self, *, pool: str, node_id: str, pool_size: int, now: datetime) -> QuarantineDecision:
        """Allow and record an automatic pull, or refuse it with an alert for an operator.

        Asking again for a node already pulled in the window is allowed and not counted twice,
        so a retried workflow step cannot trip the breaker by itself.
        """
        if pool_size < 1:
            raise ValueError("pool_size must be at least 1")
        recent = self._recent(pool, now)
        if any(p.node_id == node_id for p in recent):
            return QuarantineDecision(allowed=True)
        if len(recent) + 1 <= self._limit(pool_size):
            recent.append(Pull(node_id=node_id, at=now))
            return QuarantineDecision(allowed=True)
        return QuarantineDecision(
            allowed=False,
            alert=OperatorAlert(
                pool=pool,
                node_id=node_id,
                pulled_in_window=len(recent),
                pool_size=pool_size,
                max_pulled_share=self.max_pulled_share,
                window=self.window,
                at=now,
                reason=(
                    f"{len(recent)} of {pool_size} nodes in pool {pool} pulled in the last {self.window}; "
                    f"pulling {node_id} would exceed {self.max_pulled_share:.0%}: automatic quarantine "
                    "refused, an operator must decide"
                ),
            ),
        )

    def reset(self, *, pool: str) -> None:
        self.state.pulls.pop(pool, None)
