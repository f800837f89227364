"""Swarm scheduling: each chunk leaves the origin once, rack-local first, busy peers are waited for,
and a chunk held only by shunned peers is seeded again."""

from __future__ import annotations

import random

import pytest

from gpucloud.registry.manifest import digest_bytes
from gpucloud.registry.swarm import PeerPlace, Swarm, SwarmSpec
from gpucloud.registry.tracker import ORIGIN

pytestmark = pytest.mark.unit

CHUNKS = [digest_bytes(bytes([i])) for i in range(3)]
X, Y, Z = CHUNKS


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def swarm_of(racks: dict[str, str], *, chunks: list[str] = CHUNKS, clock: Clock | None = None, **options) -> Swarm:
    nodes = {node: PeerPlace(rack=rack, site="s", url=f"http://{node}") for node, rack in racks.items()}
    return Swarm(SwarmSpec(nodes=nodes, chunks=chunks), rng=random.Random(0), clock=clock or Clock(), **options)


def picks(swarm: Swarm, node: str, slots: int = 4, **kwargs) -> list[tuple[str, str]]:
    """(chunk, first source) of each assignment."""
    return [(a.chunk, a.sources[0]) for a in swarm.plan(node, slots, **kwargs).assignments]


def test_each_chunk_is_seeded_from_the_origin_once_one_per_node() -> None:
    swarm = swarm_of({"a": "r1", "b": "r1", "c": "r2", "d": "r2"})
    assert picks(swarm, "a") == [(X, ORIGIN)]
    assert picks(swarm, "a") == []  # one origin fetch per node at a time
    assert picks(swarm, "b") == [(Y, ORIGIN)]
    assert picks(swarm, "c") == [(Z, ORIGIN)]
    assert picks(swarm, "d") == []  # everything is on its way from the origin: wait, do not re-fetch
    swarm.announce("a", [X])
    assert picks(swarm, "d") == [(X, "a")]
    assert swarm.status().seeding == 2


def test_origin_slots_cap_concurrent_origin_fetches() -> None:
    swarm = swarm_of({"a": "r1", "b": "r1", "c": "r1"}, origin_slots=2)
    assert picks(swarm, "a") == [(X, ORIGIN)]
    assert picks(swarm, "b") == [(Y, ORIGIN)]
    assert picks(swarm, "c") == []
    # Announcing X in a plan request frees a's origin fetch (and an origin slot) for the next.
    assert picks(swarm, "a", held=[X]) == [(Z, ORIGIN)]
    assert picks(swarm, "c") == [(X, "a")]


def test_rarest_chunks_a_rack_local_peer_holds_come_first() -> None:
    swarm = swarm_of({"a": "r1", "b": "r1", "c": "r2"}, chunks=[X, Y])
    swarm.announce("b", [X])
    swarm.announce("c", [Y])
    plan = swarm.plan("a", 1)
    assert [(p.chunk, p.sources) for p in plan.assignments] == [(X, ["b", ORIGIN])]
    assert plan.urls == {"b": "http://b"}
    assert picks(swarm, "a") == [(Y, "c")]


def test_a_busy_holder_is_waited_for_rather_than_the_origin() -> None:
    swarm = swarm_of({"h": "r1", "a": "r1", "b": "r1"}, chunks=[X], upload_slots=1)
    swarm.announce("h", [X])
    assert picks(swarm, "a") == [(X, "h")]
    assert picks(swarm, "b") == []
    swarm.announce("a", [X])
    assert picks(swarm, "b") == [(X, "h")]


def test_a_chunk_held_only_by_a_reported_peer_is_seeded_from_the_origin() -> None:
    swarm = swarm_of({"liar": "r1", "a": "r1", "b": "r1"}, chunks=[X])
    swarm.announce("liar", [X])
    assert picks(swarm, "a") == [(X, "liar")]
    swarm.report_bad("a", "liar", X)
    assert picks(swarm, "a") == [(X, ORIGIN)]
    assert picks(swarm, "b") == []  # a is seeding it
    assert swarm.status().bad_reports == 1
    with pytest.raises(ValueError):
        swarm.report_bad("a", ORIGIN, X)


def test_a_stalled_seed_is_handed_to_another_node_after_the_timeout() -> None:
    clock = Clock()
    swarm = swarm_of({"a": "r1", "b": "r1"}, chunks=[X], clock=clock, seed_timeout_s=30)
    assert picks(swarm, "a") == [(X, ORIGIN)]
    assert picks(swarm, "b") == []
    clock.now = 31
    assert picks(swarm, "b") == [(X, ORIGIN)]


def test_released_and_forgotten_work_goes_back_to_the_pool() -> None:
    swarm = swarm_of({"a": "r1", "b": "r1"}, chunks=[X])
    assert picks(swarm, "a") == [(X, ORIGIN)]
    swarm.release("a", X)
    assert picks(swarm, "b") == [(X, ORIGIN)]
    swarm.announce("b", [X])
    assert swarm.status().complete_nodes == ["b"]
    assert swarm.plan("b", 1).complete
    swarm.forget("b")
    assert swarm.status().held == {"a": 0, "b": 0}
    assert picks(swarm, "a") == [(X, ORIGIN)]
    with pytest.raises(KeyError):
        swarm.plan("stranger", 1)


def test_assignments_from_an_answer_the_node_never_got_are_released_by_its_next_plan() -> None:
    swarm = swarm_of({"h": "r1", "a": "r1"}, chunks=[X, Y])
    swarm.announce("h", [X, Y])
    assert sorted(picks(swarm, "a")) == sorted([(X, "h"), (Y, "h")])  # this answer is lost
    assert picks(swarm, "a") == []  # without word of what a fetches, both count as under way
    assert sorted(picks(swarm, "a", fetching=[])) == sorted([(X, "h"), (Y, "h")])
    assert picks(swarm, "a", fetching=[X, Y]) == []
