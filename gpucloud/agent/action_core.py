"""What a node's agent does with an action the control plane sends it, whatever hardware is under
it: the one implementation of the node protocol's action side. The production agent
(`agent/app.py`) runs it over the node's real hardware; every simulated node (`sim/nodes.py`) runs
it over simulated hardware behind the same interface (`NodeHardware`), so the two cannot drift
apart: a rule written here holds for both.

- An action is answered once per request id: a replay gets the first answer (the last
  `remembered` are kept), except a failure that a retry may not meet again (a 5xx but 501: a
  missing tool stays missing, a crash or a transient fault may not).
- Another tenant's data blocks a provision (409), a running workload blocks a wipe (409), burn-in
  and a diagnose run only on a wiped, idle node (409: a node a tenant holds is never tested);
  a provision names its tenant (422).
- The steps, in order: the action's tools, then the workload's SSH keys let in and the workload
  started (provision) or the workload stopped (release, reboot, wipe) and the keys taken out
  (release, wipe), then the tenancy changed (a wipe's cleaning first, then the credential
  it hands over), then the hardware settles it (persists, meters) and the answer is built from
  the tenancy and what the hardware says of the node (`ActionAnswer`).

Every refusal, here and in the hardware, is a problem document built by `problem`.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from fastapi.responses import JSONResponse

from gpucloud.agent.cleaning import CleaningFailed
from gpucloud.agent.spool import wall_clock_ms
from gpucloud.protocol.actions import (
    ActionAnswer,
    ActionRequest,
    AgentAction,
    CleaningStep,
    Diagnosis,
    known_action,
)
from gpucloud.protocol.reports import ProbeFatal
from gpucloud.web import problems

A = AgentAction

# (HTTP status, body): what an action is answered, a problem document from 400 on.
Outcome = tuple[int, dict]

REMEMBERED_REQUESTS = 64
# The title of every refusal of an action whose tools (or cleaning, or injected fault) failed.
ACTION_FAILED = "Action failed"
STOPS_WORKLOAD = frozenset({A.RELEASE, A.REBOOT, A.WIPE})
# The actions after which no key of the tenant opens the node (a reboot keeps its files).
ENDS_SSH_ACCESS = frozenset({A.RELEASE, A.WIPE})


def problem(status: int, title: str, detail: str, **extra: Any) -> Outcome:
    """An action's refusal as every agent words it (RFC 9457, `web/problems.py`)."""
    return status, problems.body(status, problems.slug(title), title, detail, **extra)


def action_failed(detail: str, **extra: Any) -> Outcome:
    """The action ran and failed on the hardware (422: the control plane records it, no retry)."""
    return problem(422, ACTION_FAILED, detail, **extra)


class Tenancy(Protocol):
    """What the core reads and changes of a node's state: who holds it, whether its workload
    runs, the answers it remembers, and the lock that takes one action at a time
    (`agent/host.py`'s `HostState`, a simulated node's `SimNode`)."""

    tenant_id: str | None
    workload_running: bool
    recent: OrderedDict[str, Outcome]
    lock: asyncio.Lock


class NodeFacts(NamedTuple):
    """What an answer says of the node beyond its tenancy: which node and boot, the image it
    booted, its GPUs as the probe reads them after the action, and what the hardware adds of its
    own (the production agent: its workload runner's status)."""

    node_id: str
    boot_id: str | None
    image_digest: str | None
    gpu_count: int
    is_gpu_node: bool = True
    fatal_error: ProbeFatal | None = None
    extras: Mapping[str, Any] = MappingProxyType({})


class NodeHardware(Protocol):
    """The node under the core. Each step answers None when it did what it says, else the
    refusal that says why (built with `problem`); the core stops at the first refusal."""

    async def run_tools(self, action: AgentAction) -> Outcome | None:
        """Run what the action runs on the hardware (burn-in's tests, a repair rung; for a wipe,
        check that its cleaning tools are there)."""
        ...

    async def start_workload(self, req: ActionRequest) -> Outcome | None:
        """Start what the provision names (nothing, when it names nothing)."""
        ...

    async def stop_workload(self) -> Outcome | None:
        """Stop every process of the tenant's workload."""
        ...

    async def install_ssh_keys(self, keys: Sequence[str]) -> Outcome | None:
        """Let in exactly these public keys (the provision's workload's; none: nobody) as the
        node's login user."""
        ...

    async def remove_ssh_keys(self) -> Outcome | None:
        """Let in no key of the tenant any more (release, wipe)."""
        ...

    async def clean(self) -> tuple[list[CleaningStep], CleaningFailed | None]:
        """A wipe's cleaning (`agent/cleaning.py`): every step taken, and the failure that
        stopped it, if one did."""
        ...

    def take_credential(self, credential: str) -> None:
        """Report with this agent credential from now on (the one a wipe hands over)."""
        ...

    async def diagnose(self) -> Diagnosis:
        """A diagnose's short tests (`agent/tools.py` `diagnose`): each tool's check, and what it
        found as signal observations; a tool that is not there is `not_run`."""
        ...

    async def settle(self, action: AgentAction, req: ActionRequest, *, started_ms: int) -> NodeFacts:
        """After the tenancy changed: keep it, meter it (a workload's time counts from
        `started_ms`), and say what the answer says of the node."""
        ...


def refusal(action: AgentAction, req: ActionRequest, node: Tenancy) -> Outcome | None:
    """Why the node refuses the action before anything runs (None: it does not)."""
    if action == A.PROVISION:
        if not req.tenant_id:
            return problem(422, "Tenant required", "provision needs a tenant_id")
        if node.tenant_id not in (None, req.tenant_id):
            return problem(409, "Node holds data", f"node holds data of tenant {node.tenant_id}; wipe it first")
    elif action == A.WIPE and node.workload_running:
        return problem(409, "Workload running", "a workload is still running; release the node first")
    elif action == A.BURN_IN and (node.tenant_id is not None or node.workload_running):
        return problem(409, "Node not wiped", "burn-in runs only on a wiped, idle node")
    elif action == A.DIAGNOSE and (node.tenant_id is not None or node.workload_running):
        return problem(409, "Node held by a tenant", "diagnostics run only on a wiped, idle node")
    return None


class ActionCore:
    """One node's agent answering actions: its tenancy (`state`) over its `hardware`."""

    def __init__(
        self,
        state: Tenancy,
        hardware: NodeHardware,
        *,
        remembered: int = REMEMBERED_REQUESTS,
        clock_ms: Callable[[], int] = wall_clock_ms,
    ) -> None:
        self.state, self.hardware = state, hardware
        self.remembered = remembered
        self._clock_ms = clock_ms

    async def act(self, action: AgentAction, req: ActionRequest) -> Outcome:
        async with self.state.lock:
            if req.request_id in self.state.recent:
                return self.state.recent[req.request_id]
            outcome = await self._apply(action, req)
            if outcome[0] < 500 or outcome[0] == 501:  # a missing tool stays missing; a crash may not
                self.state.recent[req.request_id] = outcome
                while len(self.state.recent) > self.remembered:
                    self.state.recent.popitem(last=False)
            return outcome

    async def _apply(self, action: AgentAction, req: ActionRequest) -> Outcome:
        s, hardware = self.state, self.hardware
        if (refused := refusal(action, req, s)) is not None:
            return refused
        if (failed := await hardware.run_tools(action)) is not None:
            return failed
        diagnosis = await hardware.diagnose() if action == A.DIAGNOSE else None
        started_ms = self._clock_ms()
        if (failed := await self._workload_and_access(action, req)) is not None:
            return failed
        cleaning = None
        if action == A.PROVISION:
            s.tenant_id, s.workload_running = req.tenant_id, True
        elif action in (A.RELEASE, A.REBOOT):
            s.workload_running = False
        elif action == A.WIPE:
            cleaning, failure = await hardware.clean()
            if failure is not None:
                # The node stays the tenant's: burn-in refuses it, and the old credential stays
                # until a wipe passes (the control plane quarantines it on this answer).
                steps = [step.model_dump(mode="json") for step in cleaning]
                return action_failed(f"wipe: {failure}", step=failure.step.step, cleaning=steps)
            s.tenant_id = None
            if req.credential:  # the tenant who had root here held the old one
                hardware.take_credential(req.credential)
        facts = await hardware.settle(action, req, started_ms=started_ms)
        answer = ActionAnswer(
            action=action,
            node_id=facts.node_id,
            tenant_id=s.tenant_id,
            workload_running=s.workload_running,
            gpu_count=facts.gpu_count,
            boot_id=facts.boot_id,
            image_digest=facts.image_digest,
            cleaning=cleaning,
            diagnosis=diagnosis,
            is_gpu_node=facts.is_gpu_node,
            fatal_error=facts.fatal_error,
            **facts.extras,
        )
        return 200, answer.model_dump(mode="json")

    async def _workload_and_access(self, action: AgentAction, req: ActionRequest) -> Outcome | None:
        """A provision lets the workload's SSH keys in, then starts it; a release, reboot or wipe
        stops every process of the allocation (before the answer), and a release or wipe then
        takes the keys out."""
        hardware = self.hardware
        if action == A.PROVISION:
            failed = await hardware.install_ssh_keys(req.workload.ssh_keys if req.workload else ())
            return failed or await hardware.start_workload(req)
        if action in STOPS_WORKLOAD:
            failed = await hardware.stop_workload()
            if failed is None and action in ENDS_SSH_ACCESS:
                failed = await hardware.remove_ssh_keys()
            return failed
        return None


async def answer_action(
    name: str, req: ActionRequest, act: Callable[[AgentAction, ActionRequest], Awaitable[Outcome]]
) -> JSONResponse:
    """`POST .../actions/{name}` as every agent's server answers it: an action no agent serves
    is a 404 naming the ones they do; a refusal is problem+json."""
    known = known_action(name)
    if known is None:
        status, body = problem(404, "Unknown action", f"unknown action {name!r}; known: {', '.join(AgentAction)}")
    else:
        status, body = await act(known, req)
    return problems.response(body, status) if status >= 400 else JSONResponse(body, status_code=status)
