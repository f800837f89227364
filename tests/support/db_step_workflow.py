"""A workflow for the DB-step test (`tests/platform/test_db_steps.py`): its own module, since
Temporal's sandbox imports a workflow's module anew (a test module, rewritten by pytest, cannot be)."""

from __future__ import annotations

from temporalio import activity, workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from gpucloud.workflows.db_steps import db_step


class Rows:
    """Two DB steps: one answers, one refuses for good (as a compare-and-swap that lost does)."""

    @activity.defn(name="db_step_test_answer")
    def answer(self, key: str) -> str:
        return key.upper()

    @activity.defn(name="db_step_test_refuse")
    async def refuse(self, key: str) -> str:
        raise ApplicationError(f"row {key} moved", type="StateConflict", non_retryable=True)


@workflow.defn(sandboxed=True)
class UsesDbSteps:
    @workflow.run
    async def run(self, key: str) -> list[str]:
        seen = [await db_step(Rows.answer, key)]
        try:
            await db_step(Rows.refuse, key)
        except ActivityError as error:  # as a remote activity's failure would arrive
            cause = error.cause
            assert isinstance(cause, ApplicationError)
            seen += [error.activity_type, cause.type or "", str(cause.non_retryable), cause.message]
        return seen
