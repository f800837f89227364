"""The house's floor plan, checked: packages sit on floors, and an import goes down (or across
one floor), never up; no two modules import each other, even through others; one module speaks
to Temporal's client for workflows; no model or contract module leans on the agent.

The graph is read from the source (`ast`), every import counted, those inside functions too (a
lazy import is still a dependency); only `if TYPE_CHECKING:` blocks are left out.

`KNOWN_*` lists what is still out of place. Each entry must still be true (a moved module takes
its entry with it), so the lists only shrink.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gpucloud"

# Lower floors never import higher ones. A floor may import its own and every floor below it.
FLOORS: dict[int, tuple[str, ...]] = {
    # What everything stands on: settings, data shapes, pure decisions.
    0: (
        "config",
        "models",
        "protocol",
        "observability",
        "db",
        "children",
        "health",
        "reconciler",
        "migrations",
        "scheduler",
    ),
    # Plumbing and the one client of each outside system; the registry's and ledger's domains.
    1: ("web", "adapters", "fabric", "storage", "registry", "ledger", "client"),
    # Business rules over the database.
    2: ("services",),
    # Durable processes and the work they call.
    3: ("activities", "workflows"),
    # Wiring: one place that picks every adapter, the worker's assembly, setup.
    4: ("bootstrap", "workers", "prepare", "shared_secrets"),
    # Processes and tools: what a person or a machine runs.
    5: ("entrypoints", "api", "console", "agent", "sim", "devstack", "demo", "cli"),
}
FLOOR = {package: floor for floor, packages in FLOORS.items() for package in packages}

# The one module that starts, signals, queries and cancels workflows and manages schedules.
GATEWAY = "gpucloud.adapters.temporal_gateway"
WORKFLOW_CLIENT_CALLS = {
    "start_workflow",
    "execute_workflow",
    "get_workflow_handle",
    "get_workflow_handle_for",
    "list_workflows",
    "count_workflows",
    "create_schedule",
    "get_schedule_handle",
    "list_schedules",
}

# Still out of place (see the module docstring): these only shrink.
KNOWN_CIRCLES: set[frozenset[str]] = set()
KNOWN_UPWARD: set[tuple[str, str]] = set()
KNOWN_WORKFLOW_CLIENTS: set[str] = set()

# Data shapes and the contracts between processes: they must load on any machine.
CONTRACTS = ("gpucloud.models", "gpucloud.protocol")


@cache
def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _parse(path: Path) -> ast.Module:
    """`ast.parse`, once more on CPython 3.11's spurious "AST constructor recursion depth
    mismatch" (python/cpython#106905: seen when another thread of the test process, a previous
    test's server, is parsing at the same moment); a real syntax error still fails."""
    source = path.read_text()
    for attempt in range(3):
        try:
            return ast.parse(source, filename=str(path))
        except SystemError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@cache
def _trees() -> dict[str, ast.Module]:
    trees = {}
    for name, path in _modules().items():
        tree = _parse(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
        trees[name] = tree
    return trees


def _owner(name: str) -> str | None:
    """The module an imported name lives in (`gpucloud.a.b.Thing` → `gpucloud.a.b`)."""
    modules = _modules()
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@cache
def _graph() -> dict[str, frozenset[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, tree in _trees().items():
        package = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    stem = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*stem, base] if base else stem)
                targets = [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                if target.startswith("gpucloud") and (owner := _owner(target)) and owner != module:
                    graph[module].add(owner)
    return {module: frozenset(graph[module]) for module in modules}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _floor(module: str) -> int | None:
    package = _package(module)
    if package in FLOOR:
        return FLOOR[package]
    return 0 if _modules()[module].parent == PACKAGE else None  # gpucloud/<file>.py: placed below


def _circles() -> Iterator[frozenset[str]]:
    """Tarjan's strongly connected components with more than one module."""
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(module: str) -> Iterator[frozenset[str]]:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph[module]:
            if other not in index:
                yield from visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = set()
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.add(other)
                if other == module:
                    break
            if len(component) > 1:
                yield frozenset(component)

    for module in sorted(graph):
        if module not in index:
            yield from visit(module)


def test_every_package_has_a_floor() -> None:
    unplaced = sorted({_package(m) for m in _modules() if _package(m) not in FLOOR and _modules()[m].parent != PACKAGE})
    assert unplaced == [], f"place these packages on a floor in FLOORS: {unplaced}"


def test_no_import_circle_between_modules() -> None:
    circles = set(_circles())
    new = sorted(sorted(c) for c in circles - KNOWN_CIRCLES)
    gone = sorted(sorted(c) for c in KNOWN_CIRCLES - circles)
    assert new == [], f"modules that import each other (through others, maybe): {new}"
    assert gone == [], f"these circles are gone: take them off KNOWN_CIRCLES: {gone}"


def test_no_import_goes_up_a_floor() -> None:
    upward = {
        (module, other)
        for module, others in _graph().items()
        for other in others
        if (here := _floor(module)) is not None and (there := _floor(other)) is not None and there > here
    }
    new = sorted(upward - KNOWN_UPWARD)
    gone = sorted(KNOWN_UPWARD - upward)
    assert new == [], f"imports from a lower floor to a higher one (see FLOORS): {new}"
    assert gone == [], f"these are fixed: take them off KNOWN_UPWARD: {gone}"


def test_one_module_speaks_to_temporal_about_workflows() -> None:
    callers = {
        module
        for module, tree in _trees().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in WORKFLOW_CLIENT_CALLS
    } - {GATEWAY}
    new = sorted(callers - KNOWN_WORKFLOW_CLIENTS)
    gone = sorted(KNOWN_WORKFLOW_CLIENTS - callers)
    assert new == [], f"start, signal or query workflows through {GATEWAY}, not from: {new}"
    assert gone == [], f"these no longer call Temporal's client: take them off KNOWN_WORKFLOW_CLIENTS: {gone}"


def test_no_model_or_contract_imports_the_agent() -> None:
    leaning = sorted(
        (module, other)
        for module, others in _graph().items()
        if module.startswith(CONTRACTS)
        for other in others
        if other.startswith("gpucloud.agent")
    )
    assert leaning == [], f"models and contracts must not import gpucloud.agent: {leaning}"


def test_the_checks_see_what_they_check() -> None:
    """The reader finds known edges, so an empty answer above means something."""
    graph = _graph()
    assert "gpucloud.models.tables" in graph["gpucloud.services.allocations"]
    assert any(c for c in _circles()) or not KNOWN_CIRCLES
    assert len(graph) > 200


def test_workflow_modules_pass_their_siblings_through_the_sandbox() -> None:
    """Temporal's sandbox runs a workflow's module anew for every workflow it starts or replays.
    `from gpucloud.workflows import options` there imports `options` through the sandboxed
    package, which runs it anew too, even inside `imports_passed_through()` (the sandbox only
    sees the package's name); `import gpucloud.workflows.options as options` passes the module
    itself through. Measured: `options` ran 58 times in `tests/fleet/test_node_lifecycle_workflow.py`
    the first way, once the second (its table of retry policies built every time)."""
    through_the_package = sorted(
        (module, alias.name)
        for module, tree in _trees().items()
        if module.startswith("gpucloud.workflows.")
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.level > 0 or node.module == "gpucloud.workflows")
        for alias in node.names
    )
    assert through_the_package == [], f"import these as `import gpucloud.workflows.X as X`: {through_the_package}"
    passed = [m for m, tree in _trees().items() if "import gpucloud.workflows.options as options" in ast.unparse(tree)]
    assert len(passed) > 10  # the check reads the workflow modules it means


def test_workflow_modules_build_no_dataclass() -> None:
    """A workflow module runs anew for every instance, and a frozen dataclass is built with
    `exec`: `NodeOperationWorkflow`'s two step classes were 60% of its module's run (7.5 of
    12 ms under load, measured by exec-ing its code 50 times), so its table of steps lives in
    `workflows/node_steps.py`, which the sandbox passes through."""
    workflow_modules = {
        module: tree
        for module, tree in _trees().items()
        if module.startswith("gpucloud.workflows.") and "workflow.defn" in ast.unparse(tree)
    }
    building = sorted(
        (module, node.name)
        for module, tree in workflow_modules.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list)
    )
    assert building == [], f"move these into a module the sandbox passes through: {building}"
    assert "gpucloud.workflows.node_lifecycle" in workflow_modules and len(workflow_modules) > 10
