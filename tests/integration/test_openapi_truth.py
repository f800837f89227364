"""The API's OpenAPI document tells the truth: schemathesis generates requests for every
operation from the document itself and sends them to a live API (a bounded number each); no
answer is a 5xx other than a 503 the document declares, and every answer's status, content type
and body match what the document says for that operation."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.one_database


@schemathesis.check
def only_declared_unavailability(ctx, response, case) -> None:
    """No 5xx but a 503 that says when to come back (`Retry-After`), or a 501 for what this
    deployment does not do (billing without a ledger)."""
    status = response.status_code
    if status >= 500 and status != 501 and not (status == 503 and response.headers.get("retry-after")):
        raise AssertionError(f"{status} without Retry-After: {response.text[:300]}")


CHECKS = [only_declared_unavailability, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES = 4


def test_every_operation_answers_as_its_openapi_document_says(db_url, make_harness) -> None:
    h = make_harness(db_url, nodes=2)
    h.enroll_fleet()
    _, tenant_key = h.new_tenant()
    schema = schemathesis.openapi.from_url(f"{h.api.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 70
    # The 422 FastAPI would advertise is not there: every error body is a problem document.
    assert "HTTPValidationError" not in str(schema.raw_schema)
    failures = []
    for operation in operations:
        # Registry and billing routes are the tenant's; the rest the operator's (both try both).
        for who, token in (("operator", h.settings.operator_token), ("tenant", tenant_key)):
            try:
                check_operation(operation, h.api.url, token)
            except (Exception, BaseExceptionGroup) as exc:
                failures.append(f"{operation.label} as the {who}: {_first_lines(exc)}")
    assert not failures, "\n".join(failures)


def _first_lines(exc: BaseException) -> str:
    text = "; ".join(str(e) for e in getattr(exc, "exceptions", [exc]))
    return " ".join(text.split())[:600]


def check_operation(operation, base_url: str, token: str) -> None:
    @settings(
        max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(case=operation.as_strategy())
    def call(case) -> None:
        case.call_and_validate(
            base_url=base_url, headers={"Authorization": f"Bearer {token}"}, checks=CHECKS, timeout=30
        )

    call()
