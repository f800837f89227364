"""The stack does what the policy decides (issue 43's `stack_matches_policy`): a small sample of
requests goes through the API, the workflows and the simulated fleet (benchmarks/scheduling_stack.py,
the driver `benchmarks/scheduling.py --stack` uses), and its placements are compared with the
policy replayed in process on the stack's own service times (`gpucloud.scheduler.stack_check`).

The sample is a known case: on 8 nodes in one fabric domain, `a` holds 6 nodes, `head` wants all 8,
`small` backfills onto the 2 left (it ends before the head can start) and `long` may not (it would
delay the head), then 16 more of 1 to 4 nodes from two tenants. Each placement the stack made must
be what the policy decides on the stack's state at that instant (`stack_check.audit`), with no
node in two allocations and every gang in one domain; and the same audit must find that the stack
does not follow FIFO (which would not have backfilled `small`)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from gpucloud.config import SchedulerSettings
from gpucloud.scheduler.policy import Node, Pool
from gpucloud.scheduler.replay import fifo_decide
from gpucloud.scheduler.stack_check import SampleRequest, audit, replay_observed
from gpucloud.services.scheduling import policy_settings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from scheduling_stack import drive

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

POLL_S = 0.5
WATCH_S = 0.2  # how often the driver reads the rows (and the queue's head the next plan keeps)
# A plan reads its rows a moment after its `now`: up to three polls on a loaded 2-core machine.
READ_SLACK_S = 3 * POLL_S


def _sample() -> list[SampleRequest]:
    known = [
        SampleRequest("a", "t1", 6, 0.0, 6.0),
        SampleRequest("head", "t2", 8, 0.5, 3.0),
        SampleRequest("small", "t1", 2, 1.0, 2.0),
        SampleRequest("long", "t2", 2, 1.5, 20.0),
    ]
    rng = random.Random(43)
    more = [
        SampleRequest(f"r{i:02d}", ("t1", "t2")[i % 2], rng.choice((1, 1, 2, 4)), 2.0 + 0.5 * i, rng.choice((2.0, 3.0)))
        for i in range(16)
    ]
    return known + more


async def test_a_sample_through_the_stack_is_placed_in_the_policys_order(ready_fleet):
    scheduler = {"poll_s": POLL_S, "queue_recheck_s": 5}
    h = await ready_fleet(nodes=8, latency_scale=0.0, scheduler=scheduler)
    sample = _sample()
    keys = {t: (await h.onboard())[1] for t in ("t1", "t2")}
    run = await drive(h.api.url, h.settings.database_url, keys, sample, watch_s=WATCH_S, timeout_s=240)

    assert (run.node_overlaps, run.unresolved, run.gangs_outside_one_domain, run.failures) == (0, [], [], {})
    assert all(run.placed[r.id] is not None for r in sample)
    with h.operator as op:
        nodes = [Node(n["id"], Pool("H100", "us-east-1"), n["pod"]) for n in op.get("/v1/nodes").json()["items"]]
    observed = [SampleRequest(r.id, r.tenant, r.nodes, run.submitted[r.id], r.expected_s) for r in sample]
    settings = policy_settings(SchedulerSettings(**scheduler))
    pool = Pool("H100", "us-east-1")
    checked = audit(
        run.allocations,
        run.nodes,
        pool=pool,
        settings=settings,
        poll_s=POLL_S,
        tolerance_s=2 * POLL_S,
        read_slack_s=READ_SLACK_S,
        heads_seen=run.heads,
        watch_s=WATCH_S,
    )
    # Every placement as decided, give or take one plan that read its rows late on a busy machine.
    assert checked.placed == len(sample) and checked.matches >= 0.95, checked
    # The known case as the policy decides it: `small` backfilled ahead of `head`, `long` after it.
    placed = {r: t for r, t in run.placed.items() if t is not None}
    assert placed["small"] < placed["head"] < placed["long"], placed

    # The audit finds a policy the stack does not follow: FIFO would not have backfilled `small`.
    fifo = audit(
        run.allocations,
        run.nodes,
        pool=pool,
        settings=settings,
        poll_s=POLL_S,
        tolerance_s=2 * POLL_S,
        read_slack_s=READ_SLACK_S,
        heads_seen=run.heads,
        watch_s=WATCH_S,
        decide_fn=fifo_decide,
    )
    assert run.allocation_of["small"] in fifo.not_decided and fifo.matches < 1.0, fifo

    # The whole run replayed through the policy alone, on the stack's service times, starts the
    # known case in the same order.
    policy = replay_observed(observed, nodes, run.services, settings=settings)
    assert policy["small"] < policy["head"] < policy["long"], policy
