"""Carrying out a pull the health rules decided (`health.pulls.PullDecision`), in one place for
the API (agents' reports, operators' injected XIDs) and the reconciler (which re-derives the pull
from the node's record, so a lost signal is sent again).

A replacement is the allocation's workflow's to make: it is signalled, through the gateway. A
drain of a node no allocation holds is the reconciler's: a targeted sweep of those nodes starts
it within the reconciler's limits (the reconciler itself starts its drains as it plans them, and
hands only its replacements here). The intent is in the DB before either (the node cordoned,
a drain requested), so a signal that is lost costs time, never the pull.

Each pull also opens its incident (`workflows/incident.py`, `docs/health.md` "Incidents"),
keyed by the node and the pulling condition's start, so the reconciler's re-sent pull joins the
one the API's opened. An engine that does not take the start never fails the pull: it is
logged, and the reconciler's next sweep that pulls the node (a replacement re-derived from the
record) opens it then. A judgement that holds a node in a correlated burst, or whose pull
the circuit breaker refused, wrote a fleet-kind incident's row (`services.fleet_kind_incidents`):
`act_on` starts its workflow the same way (`open_fleet_incidents`), and the reconciler's sweep
starts any that nobody follows.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from datetime import datetime

from temporalio.client import Client
from temporalio.service import RPCError

from gpucloud.adapters.temporal_gateway import reconcile_now, signal_replace_node, start_incident
from gpucloud.config import Settings
from gpucloud.health.pulls import PullDecision, PullKind, pulling_since
from gpucloud.models.incident_messages import IncidentInput
from gpucloud.models.messages import ReplaceNodeRequest
from gpucloud.models.workflow_ids import incident_workflow_id
from gpucloud.protocol.reports import utc_now
from gpucloud.services import fleet_kind_incidents
from gpucloud.services.health import HealthOutcome
from gpucloud.services.workflow_engine import log_undelivered, waited_out
from gpucloud.web import metrics

log = logging.getLogger(__name__)


def replace_request(settings: Settings, decision: PullDecision) -> ReplaceNodeRequest:
    return ReplaceNodeRequest(
        node_id=decision.node_id,
        reason=decision.reason[:1000],
        immediate=decision.immediate,
        grace_s=settings.health.drain_grace_s,
        recheck_s=settings.health.replacement_recheck_s,
        fault_at=decision.fault_at,
    )


async def carry_out(
    client: Client, settings: Settings, decisions: Sequence[PullDecision]
) -> list[tuple[PullDecision, RPCError]]:
    """Signal each replacement to its allocation's workflow, then ask the reconciler to drain the
    drains now; returns the replacements whose signal the engine did not take (the node stays
    cordoned, and the reconciler sends it again)."""
    undelivered: list[tuple[PullDecision, RPCError]] = []
    for decision in decisions:
        if decision.kind != PullKind.REPLACE or decision.allocation_id is None:
            continue
        try:
            await signal_replace_node(client, decision.allocation_id, replace_request(settings, decision))
        except RPCError as exc:
            undelivered.append((decision, exc))
    await open_incidents(client, settings, decisions)
    drains = [d.node_id for d in decisions if d.kind == PullKind.DRAIN]
    if drains:
        await reconcile_now(client, settings, drains)
    return undelivered


def incident_input(settings: Settings, decision: PullDecision) -> IncidentInput | None:
    """The incident a pull opens; None for a pull whose fault has no moment to key it by."""
    detected_at = decision.detected_at
    if decision.kind == PullKind.NONE or detected_at is None:
        return None
    return IncidentInput(
        node_id=decision.node_id,
        detected_at=detected_at,
        key_at=decision.since or detected_at,
        reason=decision.reason[:1000],
        allocation_id=decision.allocation_id if decision.kind == PullKind.REPLACE else None,
        poll_s=settings.health.incident_poll_s,
        max_wait_s=settings.health.incident_max_wait_s,
    )


async def open_incidents(client: Client, settings: Settings, decisions: Sequence[PullDecision]) -> list[str]:
    """Start (or join) each pull's incident; the workflow ids started. Never raises for the
    engine: a start it refused is logged and left to the reconciler's next pull of the node."""
    opened = []
    inputs = [inp for inp in (incident_input(settings, d) for d in decisions) if inp is not None]
    for index, inp in enumerate(inputs):
        try:
            opened.append(await start_incident(client, settings, inp))
        except Exception as exc:  # the pull stands without its record; the next pull opens it
            workflow_id = incident_workflow_id(inp.node_id, inp.key_at or inp.detected_at)
            if not isinstance(exc, RPCError):
                log.warning("incident %s not opened (%s); the pull stands", workflow_id, exc)
                continue
            log_undelivered(log, exc, f"incident {workflow_id}", "the pull stands; the next pull opens it")
            if waited_out(exc) and index + 1 < len(inputs):
                # The engine does not answer: the rest would wait as long each, for the same.
                log.warning(
                    "%d more incidents not opened: the workflow engine does not answer", len(inputs) - index - 1
                )
                break
    return opened


def fleet_incident_input(settings: Settings, start: fleet_kind_incidents.IncidentStart) -> IncidentInput:
    return IncidentInput(
        node_id=start.node_id,
        kind=fleet_kind_incidents.FLEET,
        workflow_id=start.workflow_id,
        incident_id=start.incident_id,
        detected_at=start.detected_at,
        poll_s=settings.health.incident_poll_s,
        max_wait_s=settings.health.incident_max_wait_s,
    )


async def open_fleet_incidents(
    client: Client, settings: Settings, starts: Sequence[fleet_kind_incidents.IncidentStart]
) -> list[str]:
    """Start (or join) the workflow of each fleet-kind incident (a burst, a breaker trip) whose
    row the judgement wrote; the workflow ids started. Never raises for the engine: a start it
    refused is logged, and the reconciler's sweep starts what nobody follows."""
    opened: list[str] = []
    unique = list({s.workflow_id: s for s in starts}.values())
    for index, start in enumerate(unique):
        try:
            opened.append(await start_incident(client, settings, fleet_incident_input(settings, start)))
        except Exception as exc:  # the judgement stands; the sweep starts it
            if not isinstance(exc, RPCError):
                log.warning("incident %s not started (%s); the sweep starts it", start.workflow_id, exc)
                continue
            log_undelivered(log, exc, f"incident {start.workflow_id}", "the sweep starts it")
            if waited_out(exc) and index + 1 < len(unique):
                log.warning(
                    "%d more incidents not started: the workflow engine does not answer", len(unique) - index - 1
                )
                break
    return opened


def first_seen(items: Sequence) -> dict[str, datetime]:
    """The earliest timestamp each node reported in a batch: when its fault happened."""
    first: dict[str, datetime] = {}
    for item in items:
        if item.node_id not in first or item.timestamp < first[item.node_id]:
            first[item.node_id] = item.timestamp
    return first


async def act_on(
    client: Client, settings: Settings, outcomes: Sequence[HealthOutcome], fault_at: dict[str, datetime]
) -> None:
    """Carry out the pulls a judgement decided (and cordoned in its own transaction)."""
    now = utc_now()
    decisions = []
    for outcome in outcomes:
        if outcome.pull == PullKind.NONE:
            continue
        if outcome.node_id in fault_at:
            metrics.FAULT_TO_CORDON.observe(max(0.0, (now - fault_at[outcome.node_id]).total_seconds()))
        decision = outcome.decision(fault_at=fault_at.get(outcome.node_id))
        decisions.append(dataclasses.replace(decision, since=pulling_since(outcome.verdict.conditions)))
    for decision, exc in await carry_out(client, settings, decisions):
        what = f"replace signal for {decision.node_id} in {decision.allocation_id}"
        log_undelivered(log, exc, what, "the node is cordoned all the same")
    starts = [o.incident for o in outcomes if o.incident is not None]
    if starts:
        await open_fleet_incidents(client, settings, starts)
