"""Ingest's checks that read the database: identity, allocation, price, overlap.

Each stage takes the candidates still standing and returns those that pass, rejecting the
others through ``reject``; they run in the ledger's write transaction, so what they read cannot
change before the batch is booked. Every stage reads in bulk (one query per node, or per time
cluster of a node) and has a fast path for the usual batch: one node's contiguous backlog of
one allocation. The rules are in ``ingest.py``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from operator import le
from typing import TypeVar

from sqlalchemy import Connection, insert, select

from gpucloud.ledger import problems
from gpucloud.ledger.batch import (
    CONTENT_FIELDS,
    Candidate,
    Reject,
    allocation_field,
    content_field,
    end_of,
    index_of,
    line_fields,
    node_field,
    rate_key_field,
    sample_of,
    seq_field,
    start_of,
    tenant_field,
)
from gpucloud.ledger.pricing import PriceBookHistory, Rate
from gpucloud.ledger.schemas import UsageSampleIn
from gpucloud.ledger.tables import allocation_events, usage_conflicts, usage_samples

# Samples of one node further apart than this are looked up as separate clusters, so a batch
# mixing an old retried sample with new ones does not read the whole history in between.
_CLUSTER_GAP_MS = 3_600_000

T = TypeVar("T")


def _distinct(candidates: list[Candidate], field: Callable[[UsageSampleIn], T]) -> set[T]:
    """The values of one field across the candidates' samples (a batch has a handful)."""
    return set(map(field, map(sample_of, candidates)))


def _by_node(candidates: list[Candidate]) -> dict[str, list[Candidate]]:
    nodes = _distinct(candidates, node_field)
    # A shipper's batch is one node's backlog: skip the grouping loop when that is so.
    if len(nodes) <= 1:
        return {nodes.pop(): candidates} if nodes else {}
    grouped: dict[str, list[Candidate]] = defaultdict(list)
    for candidate in candidates:
        grouped[candidate.sample["node_id"]].append(candidate)
    return grouped


def drop_known(
    connection: Connection, candidates: list[Candidate], reject: Reject, now_ms: int
) -> tuple[list[Candidate], int]:
    """Split off duplicates and conflicts; returns the samples seen for the first time."""
    fresh: list[Candidate] = []
    duplicates = 0
    for node_id, node_candidates in _by_node(candidates).items():
        seqs = list(map(seq_field, map(sample_of, node_candidates)))
        stored = _stored_by_seq(connection, node_id, seqs)
        if not stored and len(set(seqs)) == len(seqs):
            fresh.extend(node_candidates)
            continue
        first_in_batch: dict[int, UsageSampleIn] = {}
        for candidate in node_candidates:
            sample = candidate.sample
            seq = sample["seq"]
            if seq not in stored and seq not in first_in_batch:
                first_in_batch[seq] = sample
                fresh.append(candidate)
                continue
            existing_id, existing_content = stored.get(seq) or (None, content_field(first_in_batch[seq]))
            if existing_content == content_field(sample):
                duplicates += 1
                continue
            conflict_id = _record_conflict(connection, sample, existing_id, now_ms)
            reject(
                candidate,
                problems.SAMPLE_CONFLICT(
                    f"({node_id}, {seq}) was recorded with different content; this copy is kept as "
                    f"conflict {conflict_id} for review",
                    conflict_id=conflict_id,
                ),
            )
    fresh.sort(key=index_of)
    return fresh, duplicates


def _stored_by_seq(connection: Connection, node_id: str, seqs: list[int]) -> dict[int, tuple[int, tuple]]:
    columns = [usage_samples.c.seq, usage_samples.c.id, *(usage_samples.c[f] for f in CONTENT_FIELDS)]
    query = select(*columns).where(usage_samples.c.node_id == node_id)
    low, high = min(seqs), max(seqs)
    # A batch is normally a contiguous run of seqs: one index range scan. A sparse one is
    # looked up by value so it does not read every sample in between.
    if high - low < 4 * len(seqs):
        query = query.where(usage_samples.c.seq.between(low, high))
    else:
        query = query.where(usage_samples.c.seq.in_(sorted(set(seqs))))
    return {row[0]: (row[1], tuple(row[2:])) for row in connection.execute(query)}


def _record_conflict(connection: Connection, sample: UsageSampleIn, existing_id: int | None, now_ms: int) -> int:
    return connection.execute(
        insert(usage_conflicts).returning(usage_conflicts.c.id),
        {
            "node_id": sample["node_id"],
            "seq": sample["seq"],
            "existing_sample_id": existing_id,
            "received": json.dumps(dict(sample), sort_keys=True),
            "detected_ms": now_ms,
        },
    ).scalar_one()


def check_allocations(connection: Connection, candidates: list[Candidate], reject: Reject) -> list[Candidate]:
    if not candidates:
        return candidates
    tenants, allocations = _distinct(candidates, tenant_field), _distinct(candidates, allocation_field)
    tenants_with_events = set(
        connection.execute(
            select(allocation_events.c.tenant_id).where(allocation_events.c.tenant_id.in_(tenants)).distinct()
        ).scalars()
    )
    owners: dict[str, str] = {}
    gpu_types: dict[str, str] = {}
    for row in connection.execute(
        select(allocation_events.c.allocation_id, allocation_events.c.tenant_id, allocation_events.c.gpu_type)
        .where(allocation_events.c.allocation_id.in_(allocations))
        .distinct()
    ):
        owners[row.allocation_id] = row.tenant_id
        if row.gpu_type is not None:
            gpu_types[row.allocation_id] = row.gpu_type
    if not tenants_with_events and not owners:
        return candidates
    # The verdict depends on (tenant, allocation, GPU type) only: a batch has a handful.
    verdicts = {
        line: _allocation_problem(line[0], line[1], line[2], owners, gpu_types, tenants_with_events)
        for line in _distinct(candidates, line_fields)
    }
    if not any(verdicts.values()):
        return candidates
    kept = []
    for candidate in candidates:
        problem = verdicts[line_fields(candidate.sample)]
        if problem is None:
            kept.append(candidate)
        else:
            reject(candidate, problem)
    return kept


def _allocation_problem(
    tenant_id: str,
    allocation_id: str,
    gpu_type: str,
    owners: dict[str, str],
    gpu_types: dict[str, str],
    tenants_with_events: set[str],
) -> problems.Problem | None:
    owner = owners.get(allocation_id)
    if owner is not None and owner != tenant_id:
        return problems.ALLOCATION_MISMATCH(f"allocation {allocation_id} belongs to another tenant", field="tenant_id")
    expected_type = gpu_types.get(allocation_id)
    if expected_type is not None and expected_type != gpu_type:
        return problems.ALLOCATION_MISMATCH(
            f"allocation {allocation_id} runs {expected_type}, not {gpu_type}", field="gpu_type"
        )
    if owner is None and tenant_id in tenants_with_events:
        return problems.UNKNOWN_ALLOCATION(
            f"no allocation event names {allocation_id} for tenant {tenant_id}", field="allocation_id"
        )
    return None


# How far a sample may reach past the control plane's node_added / node_removed moments: the
# agent starts metering when its provision ends, the control plane records the node a moment
# later (and the reverse at release); the same edges the reconciliation report tolerates.
NODE_EDGE_TOLERANCE_MS = 60_000


def check_nodes_held(connection: Connection, candidates: list[Candidate], reject: Reject) -> list[Candidate]:
    """A sample's node must have been in its allocation over the sample's interval, by the
    allocation's node events (within `NODE_EDGE_TOLERANCE_MS`): a node's agent cannot bill
    time its node was not in the allocation, nor bill another node into it. An allocation
    without events is not checked (as in `check_allocations`); a node its allocation has not
    added yet is rejected as retryable (the control plane may send the event later), unless
    the allocation has ended (say, cancelled before it was ever ready): then it never will."""
    if not candidates:
        return candidates
    allocations, nodes = _distinct(candidates, allocation_field), _distinct(candidates, node_field)
    tracked = set(
        connection.execute(
            select(allocation_events.c.allocation_id)
            .where(allocation_events.c.allocation_id.in_(allocations))
            .distinct()
        ).scalars()
    )
    if not tracked:
        return candidates
    ended = set(
        connection.execute(
            select(allocation_events.c.allocation_id)
            .where(allocation_events.c.allocation_id.in_(tracked), allocation_events.c.kind == "end")
            .distinct()
        ).scalars()
    )
    rows = connection.execute(
        select(
            allocation_events.c.allocation_id,
            allocation_events.c.node_id,
            allocation_events.c.kind,
            allocation_events.c.at_ms,
        )
        .where(
            allocation_events.c.allocation_id.in_(tracked),
            allocation_events.c.node_id.in_(nodes),
            allocation_events.c.kind.in_(("node_added", "node_removed")),
        )
        .order_by(allocation_events.c.at_ms, allocation_events.c.id)
    )
    held: dict[tuple[str, str], list[tuple[int, int | None]]] = defaultdict(list)
    for row in rows:
        spans = held[(row.allocation_id, row.node_id)]
        if row.kind == "node_added":
            if not spans or spans[-1][1] is not None:
                spans.append((row.at_ms, None))
        elif spans and spans[-1][1] is None:
            spans[-1] = (spans[-1][0], row.at_ms)
    kept = []
    for candidate in candidates:
        sample = candidate.sample
        allocation, node = sample["allocation_id"], sample["node_id"]
        if allocation not in tracked:
            kept.append(candidate)
            continue
        node_spans = held.get((allocation, node), [])
        if not node_spans and allocation in ended:
            reject(
                candidate,
                problems.NODE_NOT_IN_ALLOCATION(f"allocation {allocation} ended without {node}", field="node_id"),
            )
            continue
        if not node_spans:
            reject(
                candidate,
                problems.NODE_NOT_YET_IN_ALLOCATION(f"allocation {allocation} has not added {node}", field="node_id"),
            )
            continue
        start, end = candidate.start_ms, candidate.end_ms
        if any(_within(start, end, added, removed) for added, removed in node_spans):
            kept.append(candidate)
        else:
            reject(
                candidate,
                problems.NODE_NOT_IN_ALLOCATION(
                    f"allocation {allocation} did not hold {node} over [{start}, {end})", field="start_ms"
                ),
            )
    return kept


def _within(start: int, end: int, added: int, removed: int | None) -> bool:
    return start >= added - NODE_EDGE_TOLERANCE_MS and (removed is None or end <= removed + NODE_EDGE_TOLERANCE_MS)


def price(history: PriceBookHistory, candidates: list[Candidate], reject: Reject) -> list[Candidate]:
    if not candidates:
        return candidates
    rate_keys = _distinct(candidates, rate_key_field)
    version, valid_from, valid_until = history.version_span(min(map(start_of, candidates)))
    if len(rate_keys) == 1 and version is not None and max(map(start_of, candidates)) < valid_until:
        # The usual batch: one tenant and GPU type, all under one price book version.
        rate = version.rate_for(*rate_keys.pop())
        if rate is not None:
            for candidate in candidates:
                candidate.rate = rate
                candidate.price_version_id = version.version_id
            return candidates
    kept = []
    rates: dict[tuple[str, str], Rate | None] = {}
    for candidate in candidates:
        sample = candidate.sample
        start_ms = candidate.start_ms
        if not valid_from <= start_ms < valid_until:
            version, valid_from, valid_until = history.version_span(start_ms)
            rates = {}
        key = rate_key_field(sample)
        if key not in rates:
            rates[key] = version.rate_for(*key) if version is not None else None
        rate = rates[key]
        if rate is None or version is None:
            reject(
                candidate,
                problems.UNPRICED_USAGE(f"no price for {sample['gpu_type']} at {start_ms}", field="gpu_type"),
            )
            continue
        candidate.rate = rate
        candidate.price_version_id = version.version_id
        kept.append(candidate)
    return kept


def drop_overlaps(connection: Connection, candidates: list[Candidate], reject: Reject) -> list[Candidate]:
    """Reject samples overlapping recorded usage of their node, or each other (the later start loses)."""
    kept = []
    for node_id, node_candidates in _by_node(candidates).items():
        node_candidates = sorted(node_candidates, key=start_of)
        stored = sorted(
            {
                span
                for low, high in _time_clusters(node_candidates)
                for span in _stored_intervals(connection, node_id, low, high)
            }
        )
        starts, ends = list(map(start_of, node_candidates)), list(map(end_of, node_candidates))
        if all(map(le, ends[:-1], starts[1:])) and not any(s < ends[-1] and e > starts[0] for s, e in stored):
            # The usual batch: back-to-back samples after everything recorded for the node.
            kept.extend(node_candidates)
            continue
        # One sweep in start order: recorded intervals never overlap each other, so a sample
        # collides only with what ended after its start or with the next recorded interval.
        next_stored = 0
        reach = -1
        for candidate in node_candidates:
            start_ms, end_ms = candidate.start_ms, candidate.end_ms
            while next_stored < len(stored) and stored[next_stored][0] <= start_ms:
                reach = max(reach, stored[next_stored][1])
                next_stored += 1
            if start_ms < reach or (next_stored < len(stored) and stored[next_stored][0] < end_ms):
                reject(
                    candidate,
                    problems.USAGE_OVERLAP(
                        f"[{start_ms}, {end_ms}) overlaps usage already recorded for {node_id}", field="start_ms"
                    ),
                )
                continue
            reach = end_ms
            kept.append(candidate)
    kept.sort(key=index_of)
    return kept


def _time_clusters(candidates: list[Candidate]) -> list[tuple[int, int]]:
    """[low, high) spans covering the samples (sorted by start), split where they are far apart."""
    clusters: list[tuple[int, int]] = []
    low, high = candidates[0].start_ms, candidates[0].end_ms
    for candidate in candidates[1:]:
        start_ms, end_ms = candidate.start_ms, candidate.end_ms
        if start_ms - high > _CLUSTER_GAP_MS:
            clusters.append((low, high))
            low, high = start_ms, end_ms
        elif end_ms > high:
            high = end_ms
    clusters.append((low, high))
    return clusters


def _stored_intervals(connection: Connection, node_id: str, low: int, high: int) -> list[tuple[int, int]]:
    """Recorded intervals of a node that can overlap [low, high)."""
    columns = (usage_samples.c.start_ms, usage_samples.c.end_ms)
    of_node = usage_samples.c.node_id == node_id
    inside = connection.execute(
        select(*columns).where(of_node, usage_samples.c.start_ms >= low, usage_samples.c.start_ms < high)
    ).all()
    before = connection.execute(
        select(*columns)
        .where(of_node, usage_samples.c.start_ms < low)
        .order_by(usage_samples.c.start_ms.desc())
        .limit(1)
    ).all()
    return [tuple(row) for row in (*before, *inside)]
