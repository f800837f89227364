"""The tracker's source selection: locality order, origin as last resort, load spreading,
bad-peer handling and forgetting nodes."""

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpucloud.registry.tracker import ORIGIN, NodePlace, Tracker

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def topology(racks: dict[str, tuple[str, int]]) -> dict[str, NodePlace]:
    """{rack: (site, nodes)} -> node ids like "r1-0" placed in that rack."""
    return {
        f"{rack}-{i}": NodePlace(rack=rack, site=site) for rack, (site, count) in racks.items() for i in range(count)
    }


def make_tracker(**options) -> Tracker:
    places = topology({"r1": ("s1", 4), "r2": ("s1", 4), "r3": ("s2", 4)})
    return Tracker(places, rng=random.Random(7), **options)


def test_rack_local_peers_come_first_then_site_then_other_sites():
    tracker = make_tracker()
    tracker.announce("r3-0", ["c"])
    tracker.announce("r2-0", ["c"])
    tracker.announce("r1-1", ["c"])

    assert tracker.rank_sources("r1-0", "c") == ["r1-1", "r2-0", "r3-0", ORIGIN]
    from_r3 = tracker.rank_sources("r3-1", "c")
    assert from_r3[0] == "r3-0" and set(from_r3[1:3]) == {"r1-1", "r2-0"} and from_r3[3] == ORIGIN


def test_origin_is_the_only_source_when_no_peer_holds_the_chunk():
    tracker = make_tracker()
    assert tracker.rank_sources("r1-0", "c") == [ORIGIN]
    tracker.announce("r1-0", ["c"])
    assert tracker.rank_sources("r1-0", "c") == [ORIGIN], "a node is never its own source"
    assert tracker.rank_sources("r1-1", "c") == ["r1-0", ORIGIN]


def test_max_sources_truncates_peers_but_keeps_origin_last():
    tracker = make_tracker()
    for node in ("r1-1", "r1-2", "r1-3", "r2-0"):
        tracker.announce(node, ["c"])
    sources = tracker.rank_sources("r1-0", "c", max_sources=2)
    assert len(sources) == 3 and sources[-1] == ORIGIN
    assert set(sources[:2]) <= {"r1-1", "r1-2", "r1-3"}


def test_requests_for_one_chunk_spread_over_its_holders():
    places = topology({"r1": ("s1", 40)})
    tracker = Tracker(places, rng=random.Random(1))
    holders = ["r1-0", "r1-1", "r1-2", "r1-3"]
    for node in holders:
        tracker.announce(node, ["c"])

    first_choices = Counter()
    for node in list(places)[4:]:
        first_choices[tracker.peers_for(node, ["c"])["c"][0]] += 1

    assert set(first_choices) == set(holders)
    assert max(first_choices.values()) - min(first_choices.values()) <= 1
    assert all(tracker.load(peer) == first_choices[peer] for peer in holders)


def test_finished_transfers_free_their_source():
    tracker = make_tracker()
    tracker.announce("r1-1", ["a", "b"])
    tracker.peers_for("r1-0", ["a", "b"])
    assert tracker.load("r1-1") == 2
    tracker.announce("r1-0", ["a"])
    tracker.release("r1-0", "b")
    assert tracker.load("r1-1") == 0
    assert tracker.holders("a") == {"r1-0", "r1-1"}


def test_asking_again_for_a_chunk_replaces_the_earlier_assignment():
    tracker = make_tracker()
    tracker.announce("r1-1", ["c"])
    tracker.peers_for("r1-0", ["c"])
    tracker.peers_for("r1-0", ["c"])
    assert tracker.load("r1-1") == 1


def test_peers_with_every_upload_slot_busy_are_not_offered():
    tracker = make_tracker(upload_slots=1)
    tracker.announce("r1-1", ["c"])
    tracker.announce("r2-1", ["c"])
    assert tracker.peers_for("r1-0", ["c"])["c"][0] == "r1-1"
    assert tracker.peers_for("r1-2", ["c"])["c"][0] == "r2-1", "busy rack-local peer is skipped"
    assert tracker.rank_sources("r1-3", "c") == [ORIGIN]
    assert not tracker.has_free_slot("r1-1")
    tracker.announce("r1-0", ["c"])
    assert tracker.has_free_slot("r1-1")


def test_a_sampled_large_tier_still_finds_its_only_free_peer():
    places = topology({"r1": ("s1", 1), "r2": ("s1", 200)})
    tracker = Tracker(places, rng=random.Random(3), upload_slots=1, sample_size=4)
    holders = [node for node in places if node.startswith("r2")]
    for node in holders:
        tracker.announce(node, ["c"])
    for peer in holders[:-1]:
        tracker.assign("r1-0", f"other-{peer}", peer)
    assert tracker.rank_sources("r1-0", "c") == [holders[-1], ORIGIN]


def test_a_peer_reported_bad_is_skipped_for_that_chunk_for_a_while():
    clock = FakeClock()
    tracker = make_tracker(clock=clock, bad_chunk_ttl_s=60)
    tracker.announce("r1-1", ["c", "d"])
    tracker.announce("r2-0", ["c"])

    tracker.report_bad("r1-1", "c")
    assert tracker.rank_sources("r1-0", "c") == ["r2-0", ORIGIN]
    assert tracker.rank_sources("r1-0", "d") == ["r1-1", ORIGIN], "other chunks are still served"

    clock.now += 61
    assert tracker.rank_sources("r1-0", "c")[0] == "r1-1"


def test_a_peer_with_repeated_bad_reports_is_quarantined_for_every_chunk():
    clock = FakeClock()
    tracker = make_tracker(clock=clock, strikes_to_quarantine=3, quarantine_s=300)
    tracker.announce("r1-1", ["a", "b", "c", "d"])
    for chunk in ("a", "b", "c"):
        tracker.report_bad("r1-1", chunk)
    assert tracker.rank_sources("r1-0", "d") == [ORIGIN]
    clock.now += 301
    assert tracker.rank_sources("r1-0", "d") == ["r1-1", ORIGIN]


def test_the_origin_cannot_be_reported_bad_and_unknown_nodes_are_rejected():
    tracker = make_tracker()
    with pytest.raises(ValueError):
        tracker.report_bad(ORIGIN, "c")
    with pytest.raises(ValueError):
        tracker.announce("nowhere-0", ["c"])
    with pytest.raises(ValueError):
        Tracker({ORIGIN: NodePlace(rack="r", site="s")})


def test_forget_removes_a_node_and_its_transfers():
    tracker = make_tracker()
    tracker.announce("r1-1", ["c"])
    tracker.announce("r2-0", ["c", "d"])
    tracker.peers_for("r1-0", ["c"])  # from r1-1
    tracker.peers_for("r1-1", ["d"])  # r1-1 fetching d from r2-0
    assert tracker.load("r1-1") == 1 and tracker.load("r2-0") == 1

    tracker.forget("r1-1")

    assert tracker.holders("c") == {"r2-0"}
    assert tracker.rank_sources("r1-0", "c") == ["r2-0", ORIGIN]
    assert tracker.load("r1-1") == 0
    assert tracker.load("r2-0") == 0, "the forgotten node's own fetches are released"
    tracker.announce("r1-0", ["c"])  # the receiver of the vanished source finishes elsewhere
    assert tracker.load("r2-0") == 0


def test_same_rng_seed_gives_the_same_plan():
    def plan(seed: int) -> list[list[str]]:
        places = topology({"r1": ("s1", 30)})
        tracker = Tracker(places, rng=random.Random(seed))
        for node in list(places)[:10]:
            tracker.announce(node, ["c"])
        return [tracker.peers_for(node, ["c"])["c"] for node in list(places)[10:]]

    assert plan(5) == plan(5)


TIER_OF = {"rack": 0, "site": 1, "world": 2}


@settings(max_examples=60, deadline=None)
@given(
    holdings=st.lists(st.tuples(st.integers(0, 17), st.sampled_from("abc")), max_size=40),
    busy=st.lists(st.integers(0, 17), max_size=20),
    asker=st.integers(0, 17),
    seed=st.integers(0, 1000),
)
def test_rankings_respect_tier_then_load_order(holdings, busy, asker, seed):
    places = topology({"r1": ("s1", 6), "r2": ("s1", 6), "r3": ("s2", 6)})
    names = list(places)
    tracker = Tracker(places, rng=random.Random(seed), sample_size=3)
    for node, chunk in holdings:
        tracker.announce(names[node], [chunk])
    for i, peer in enumerate(busy):
        tracker.assign(f"{names[(peer + 1) % len(names)]}", f"busy-{i}", names[peer])
    me = names[asker]

    for chunk in "abc":
        sources = tracker.rank_sources(me, chunk, max_sources=len(names))
        peers = sources[:-1]
        assert sources[-1] == ORIGIN and ORIGIN not in peers
        assert me not in peers and len(set(peers)) == len(peers)
        others = tracker.holders(chunk) - {me}
        # Large tiers are ranked from a sample, so not every holder is listed, but some is.
        assert set(peers) <= others and bool(peers) == bool(others)

        def tier(peer: str) -> int:
            if places[peer].rack == places[me].rack:
                return TIER_OF["rack"]
            return TIER_OF["site"] if places[peer].site == places[me].site else TIER_OF["world"]

        keys = [(tier(peer), tracker.load(peer)) for peer in peers]
        assert keys == sorted(keys)
