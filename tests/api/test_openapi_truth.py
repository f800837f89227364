"""The API's OpenAPI document tells the truth, under schemathesis' default random generation.

The schemathesis CLI generates requests for every operation from the document itself (its
coverage phase, then random fuzzing until a time budget is spent, from a fixed seed) and sends
them to a live API backed by a ledger, once with a tenant's key and once with the operator's.
No answer may be a 5xx other than a 503 that says when to come back (or a 501 for what a
deployment does not do), and every answer's status, content type and body must be what the
document says for that operation: thousands of cases per role, not a few examples each."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis

from support.ledger_harness import ledger_in_thread

pytestmark = [pytest.mark.integration, pytest.mark.one_database, pytest.mark.long]

TESTS = Path(__file__).parent.parent
SEED = 20261206
# Per role: the coverage phase takes about half; fuzzing repeats until the budget is spent.
BUDGET_S = 20
CHECKS = "only_declared_unavailability,status_code_conformance,content_type_conformance,response_schema_conformance"


@pytest.fixture
def ledger_url(tmp_path: Path) -> Iterator[str]:
    with ledger_in_thread(f"sqlite:///{tmp_path / 'ledger.db'}", issuer_dir=tmp_path) as url:
        yield url


def test_every_operation_answers_as_its_openapi_document_says(db_url, make_harness, ledger_url, tmp_path) -> None:
    h = make_harness(db_url, nodes=2, ledger={"url": ledger_url})
    h.enroll_fleet()
    _, tenant_key = h.new_tenant()
    schema = schemathesis.openapi.from_url(f"{h.api.url}/openapi.json")
    assert len([result.ok() for result in schema.get_all_operations()]) > 70
    # The 422 FastAPI would advertise is not there: every error body is a problem document.
    assert "HTTPValidationError" not in str(schema.raw_schema)
    # The tenant first: the operator's run may offboard the tenant or retire nodes.
    failures = []
    for who, token in (("tenant", tenant_key), ("operator", h.settings.operator_token)):
        cases, failed = fuzz(h.api.url, token, tmp_path / f"schemathesis-{who}.log")
        # Measured: 5,120 for the tenant in 50 s on a quiet machine, 450 in 30 s beside the whole suite.
        # A time budget, not a count: a quiet machine generates over a thousand, one loaded by
        # the rest of the suite a few hundred; fewer than that means the generator stalled.
        assert cases >= 200, f"the {who}'s run generated only {cases} cases"
        if failed:
            failures.append(f"as the {who}:\n{failed}")
    assert not failures, "\n".join(failures)


def fuzz(base_url: str, token: str, log: Path) -> tuple[int, str]:
    """Run the CLI against the API as `token`: (cases generated, the failures' report or '')."""
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{base_url}/openapi.json",
        "--header",
        f"Authorization: Bearer {token}",
        "--checks",
        CHECKS,
        "--phases",
        "examples,coverage,fuzzing",
        "--seed",
        str(SEED),
        "--max-time",
        str(BUDGET_S),
        # One worker: two threads building strategies at once trip a race inside the generator.
        "--workers",
        "1",
        "--request-timeout",
        "30",
    ]
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "support.schemathesis_hooks",
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "NO_COLOR": "1",
    }
    # In its own folder: the CLI keeps a cache of past failures where it runs, to replay first.
    done = subprocess.run(
        command, cwd=log.parent, env=env, capture_output=True, text=True, timeout=BUDGET_S * 4, check=False
    )
    log.write_text(done.stdout + done.stderr)
    generated = re.search(r"(\d+) generated", done.stdout)
    cases = int(generated.group(1)) if generated else 0
    if done.returncode == 0:
        return cases, ""
    start = done.stdout.find("FAILURES")
    return cases, (done.stdout[start:] if start >= 0 else done.stdout + done.stderr)[-6000:]
