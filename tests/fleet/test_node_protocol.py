"""The node protocol is defined once (`gpucloud/protocol/`): the control plane, the agent and the
simulator name actions by `AgentAction`, build reports from its models and send them through its
`ReportClient`; nothing else spells them out, and no model under `models/` reaches into `agent/`."""

from __future__ import annotations

import ast
import functools
import json
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

import gpucloud
from gpucloud.protocol import actions as protocol_actions
from gpucloud.protocol import reports as protocol_reports
from gpucloud.protocol.actions import ActionAnswer, AgentAction, known_action
from gpucloud.protocol.reporter import EVENTS_PATH, HEARTBEATS_PATH, READINGS_PATH, ReportClient
from gpucloud.protocol.reports import Heartbeat, XidEvent
from support.readings import node_reading

pytestmark = pytest.mark.unit

PACKAGE = Path(gpucloud.__file__).parent
PROTOCOL = PACKAGE / "protocol"

# Where an action's name appears as a word of something else, with why.
NOT_ACTIONS = {
    ("agent/tools.py", "reboot"): "systemctl's argv (`systemctl reboot`)",
    ("agent/workloads.py", "inspect"): "podman's and docker's subcommand",
    ("cli/main.py", "release"): "a database's alembic release in `gpucloud db` output",
    ("models/node_states.py", "burn_in"): "the node state the burn-in action runs in",
    ("models/node_states.py", "inspect"): "the lifecycle event that starts inspection",
    ("models/node_states.py", "provision"): "the lifecycle event that starts provisioning",
    ("models/node_states.py", "release"): "the lifecycle event that starts releasing",
    ("models/messages.py", "provision"): "the node operation that provisions (several steps)",
    ("models/messages.py", "release"): "the node operation that releases (several steps)",
    ("models/messages.py", "diagnose"): "the node operation that diagnoses (lease, action, record)",
    ("health/incidents.py", "diagnose"): "an incident's phase (its cause found)",
}
REPORT_PATHS = {HEARTBEATS_PATH, READINGS_PATH, EVENTS_PATH}


@functools.cache
def _parsed() -> tuple[tuple[str, ast.Module], ...]:
    """Every module of the package (its path under gpucloud/, its syntax tree), parsed once."""
    return tuple(
        (path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(), str(path)))
        for path in sorted(PACKAGE.rglob("*.py"))
    )


def _modules() -> list[tuple[str, ast.Module]]:
    """Every module but the protocol's own."""
    return [(module, tree) for module, tree in _parsed() if not module.startswith("protocol/")]


def test_action_names_are_spelled_only_in_the_protocol():
    names = {a.value for a in AgentAction}
    found = sorted(
        f"{module}:{node.lineno}: {node.value!r}"
        for module, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in names and (module, node.value) not in NOT_ACTIONS
    )
    assert not found, f"action names outside gpucloud/protocol (use AgentAction): {found}"


def test_heartbeats_and_report_paths_are_built_only_in_the_protocol():
    heartbeat = {"node_id", "workload_running", "boot_id"}
    found = []
    for module, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
                if heartbeat <= keys or keys in ({"heartbeats"}, {"readings"}, {"events"}):
                    found.append(f"{module}:{node.lineno}: a hand-built report {sorted(keys)}")
            if isinstance(node, ast.Constant) and node.value in REPORT_PATHS:
                found.append(f"{module}:{node.lineno}: {node.value} (send it with ReportClient)")
    assert not found, found


def test_the_protocols_models_are_defined_once():
    defined = {
        name
        for module in (protocol_actions, protocol_reports)
        for name, value in vars(module).items()
        if isinstance(value, type) and value.__module__ == module.__name__
    }
    again = sorted(
        f"{module}:{node.lineno}: class {node.name}"
        for module, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.name in defined
    )
    assert not again, f"protocol models defined a second time: {again}"


def test_no_model_imports_the_agent():
    found = []
    for module, tree in _parsed():
        if not module.startswith(("models/", "protocol/")):
            continue
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            found += [f"{module}:{node.lineno}: {n}" for n in names if n.startswith("gpucloud.agent")]
    assert not found, f"models and the protocol import nothing from gpucloud.agent: {found}"


def test_actions_are_answered_in_one_place():
    """The action core (`agent/action_core.py`) is the only code that builds an action's answer
    or words the node's refusals: the production agent and the simulated nodes both run it."""
    core = "agent/action_core.py"
    titles = {"Tenant required", "Node holds data", "Workload running", "Node not wiped", "Unknown action"}
    found = []
    for module, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ActionAnswer" and module != core:
                found.append(f"{module}:{node.lineno}: an ActionAnswer built outside the action core")
            if isinstance(node, ast.Constant) and node.value in titles and module != core:
                found.append(f"{module}:{node.lineno}: the refusal {node.value!r} worded outside the action core")
    assert not found, found


def test_an_unknown_action_is_none_and_an_answer_keeps_what_each_agent_adds():
    assert known_action("burn_in") is AgentAction.BURN_IN and known_action("format_c") is None
    answer = ActionAnswer(action="wipe", node_id="n1", gpu_count=8, hardware_fault="gpu 3 off the bus")
    assert answer.model_dump(mode="json")["hardware_fault"] == "gpu 3 off the bus"


async def test_the_report_client_posts_each_batch_to_its_path_with_the_senders_credential():
    sent: list[tuple[str, str | None, dict]] = []

    def control_plane(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.path, request.headers.get("authorization"), json.loads(request.content)))
        return httpx.Response(200, json={})

    now = datetime(2026, 12, 6, tzinfo=UTC)
    async with httpx.AsyncClient(transport=httpx.MockTransport(control_plane)) as client:
        reports = ReportClient(client, "http://cp/")
        await reports.heartbeats([Heartbeat(node_id="n1", boot_id="b-1")], credential="gpa_n1.secret")
        await reports.readings([node_reading("n1", now)])
        event = XidEvent(node_id="n1", gpu_index=3, xid=79, timestamp=now)
        await reports.events([event], credential="gpa_n1.secret")
    assert [(path, auth) for path, auth, _ in sent] == [
        (HEARTBEATS_PATH, "Bearer gpa_n1.secret"),
        (READINGS_PATH, None),
        (EVENTS_PATH, "Bearer gpa_n1.secret"),
    ]
    assert sent[0][2]["heartbeats"][0] == {
        "node_id": "n1",
        "tenant_id": None,
        "workload_running": False,
        "boot_id": "b-1",
        "workload": None,
    }
    assert sent[2][2]["events"][0]["xid"] == 79


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b'{"action": "wipe", "node_id": "n-1", "gpu_count": 8, "tenant_id": "not a tenant id!"}', "tenant_id"),
        (b'{"action": "wipe", "node_id": "n-1"}', "gpu_count"),
        (b"all clean, trust me", "body"),
        (b'{"action": "burn_in", "node_id": "n-1", "gpu_count": 8}', "not this action's answer"),
        (b'{"action": "wipe", "node_id": "n-2", "gpu_count": 8}', "not this action's answer"),
    ],
)
async def test_an_answer_the_protocol_does_not_allow_is_refused_never_taken_as_done(body: bytes, why: str) -> None:
    """Whatever answers on a node may be the previous tenant's program: the control plane's one
    client of agents reads every 200 as an `ActionAnswer` for this action on this node."""
    from gpucloud.adapters.host_agent import AgentRefused, HttpHostAgents
    from gpucloud.protocol.actions import ActionRequest, AgentAction

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "application/json"})

    agents = HttpHostAgents(transport=httpx.MockTransport(answer))
    try:
        with pytest.raises(AgentRefused, match=why):
            await agents.act("http://n-1", AgentAction.WIPE, ActionRequest(request_id="r-1"), node_id="n-1")
    finally:
        await agents.aclose()


async def test_a_well_formed_answer_keeps_what_each_agent_adds() -> None:
    from gpucloud.adapters.host_agent import HttpHostAgents
    from gpucloud.protocol.actions import ActionRequest, AgentAction

    content = b'{"action": "wipe", "node_id": "n-1", "gpu_count": 8, "boot_id": "b1", "injected": 2}'
    agents = HttpHostAgents(transport=httpx.MockTransport(lambda request: httpx.Response(200, content=content)))
    try:
        done = await agents.act("http://n-1", AgentAction.WIPE, ActionRequest(request_id="r-1"), node_id="n-1")
    finally:
        await agents.aclose()
    assert done["boot_id"] == "b1" and done["injected"] == 2 and done["gpu_count"] == 8
