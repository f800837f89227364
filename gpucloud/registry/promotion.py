"""Registry domain logic behind the API: evaluation gates, lineage walks, keyrings, chunk checks.

Gates decide promotion. `evaluate_gates` is a pure function of the model's gates, the candidate's
latest results and the current production version's: it returns every failing metric (an empty
list means the move may happen), so a refusal can name all of them at once instead of one per try.

Only evaluations the platform ran and signed count (`EvaluationSource.PLATFORM`); results a tenant
reports with its own keys are kept and shown, never used. Each gate names the evaluator its metric
must come from (`sanity` or `command`), so a number from one evaluator never stands in for
another's. When the latest run of an evaluator failed (a command that hung, crashed or printed
garbage), its gates fail with that reason rather than pass on an older run's numbers.

A gate on one metric can hold an absolute range (`min`, `max`) and a maximum regression against
production. Regression is measured in the metric's own units, in the direction that makes it worse
(`higher_is_better` says which): with `max_regression=0.02` an accuracy of 0.80 may replace 0.81
but not 0.83. A metric the candidate has no result for fails its gate: promotion never proceeds on
numbers nobody measured. Without a production version, or when production has no result for the
metric, there is nothing to regress against and only the range applies.

Besides a model's own gates, the platform fails closed with gates of its own (`platform_failures`),
which no model can loosen: a version whose latest platform run of any evaluator failed, or whose
sanity evaluation counted a NaN or Inf weight, moves to neither `staging` nor `production`; and
`production` takes only a version with a passing platform `sanity` evaluation, unless the operator
turns that off (`registry.production_requires_sanity`). A model without gates is not a model whose
versions go anywhere unchecked.

Lineage is a forest of versions linked by `parent` digests, per tenant. The walks are pure too:
they take lookup functions, so the same code runs over the DB (`ancestors`, `descendants`) and
over plain dicts in tests, and they stop on cycles and at a depth limit, so a corrupt index can
never loop a request.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import sqlalchemy as sa
from pydantic import BaseModel
from sqlmodel import Session, col, select

from gpucloud.models.registry_names import GATED_ALIASES, AliasName, EvaluatorName
from gpucloud.models.registry_tables import (
    EvaluationCommand,
    EvaluationGate,
    EvaluationResult,
    EvaluationSource,
    GateSpec,
    ModelAlias,
    ModelAliasPublic,
    ModelPublic,
    ModelVersion,
    ModelVersionPublic,
    RegistryModel,
    SigningKey,
)
from gpucloud.registry.manifest import Keyring
from gpucloud.registry.store import ChunkStore

MAX_LINEAGE_DEPTH = 1000
CHUNK_CHECK_CONCURRENCY = 16  # S3 answers one HEAD per chunk; a few in flight hide the latency


class GateFailure(BaseModel):
    """One failing metric, with the numbers that made it fail (no metric: the evaluation as a whole)."""

    metric: str | None
    evaluator: str
    reason: str
    value: float | None
    min: float | None = None
    max: float | None = None
    max_regression: float | None = None
    production_value: float | None = None

    def describe(self) -> str:
        if self.metric is None:
            return f"{self.evaluator} evaluation: {self.reason}"
        if self.value is None:
            return f"{self.metric} ({self.evaluator}): {self.reason}"
        return f"{self.metric} ({self.evaluator})={self.value:g}: {self.reason}"


Results = Mapping[str, Mapping[str, float]]
"""A version's results by evaluator: evaluator -> metric -> value."""


class VersionResults(BaseModel):
    """What a version's evaluation records add up to: the platform's results by evaluator, the
    evaluators whose latest platform run failed (and why), and what the tenant reported."""

    platform: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    reported: dict[str, float] = {}

    @property
    def metrics(self) -> dict[str, float]:
        """The platform's results of every evaluator in one mapping (for listings)."""
        merged: dict[str, float] = {}
        for evaluator in sorted(self.platform):
            merged.update(self.platform[evaluator])
        return merged


def evaluate_gates(
    gates: Iterable[GateSpec],
    candidate: Results,
    production: Results | None,
    *,
    errors: Mapping[str, str] | None = None,
) -> list[GateFailure]:
    """Every gate the candidate's results fail, in the order the gates are given. `errors`: the
    evaluators whose latest run failed, and why."""
    failures = []
    for gate in gates:
        evaluator = gate.source.value
        bounds = {"min": gate.min, "max": gate.max, "max_regression": gate.max_regression, "evaluator": evaluator}
        if evaluator in (errors or {}):
            reason = f"the latest {evaluator} evaluation failed: {(errors or {})[evaluator]}"
            failures.append(GateFailure(metric=gate.metric, reason=reason, value=None, **bounds))
            continue
        value = candidate.get(evaluator, {}).get(gate.metric)
        if value is None:
            reason = f"no result from a platform {evaluator} evaluation"
            failures.append(GateFailure(metric=gate.metric, reason=reason, value=None, **bounds))
            continue
        if gate.min is not None and value < gate.min:
            failures.append(
                GateFailure(metric=gate.metric, reason=f"below the minimum {gate.min:g}", value=value, **bounds)
            )
        if gate.max is not None and value > gate.max:
            failures.append(
                GateFailure(metric=gate.metric, reason=f"above the maximum {gate.max:g}", value=value, **bounds)
            )
        baseline = (production or {}).get(evaluator, {}).get(gate.metric)
        if gate.max_regression is None or baseline is None:
            continue
        regression = baseline - value if gate.higher_is_better else value - baseline
        # A subtraction of decimals (0.90 - 0.88) lands a hair off; exactly at the bound passes.
        if regression > gate.max_regression and not math.isclose(
            regression, gate.max_regression, rel_tol=1e-9, abs_tol=1e-12
        ):
            failures.append(
                GateFailure(
                    metric=gate.metric,
                    value=value,
                    production_value=baseline,
                    **bounds,
                    reason=f"regresses {regression:g} against production's {baseline:g} "
                    f"(at most {gate.max_regression:g} allowed)",
                )
            )
    return failures


# The sanity evaluator's one verdict no reading can excuse: a weight that is NaN or Inf.
SANITY_GATE = GateSpec(metric="nan_inf_count", max=0, evaluator=EvaluatorName.SANITY)


def platform_failures(
    alias: AliasName, candidate: VersionResults, *, gated: Iterable[GateFailure] = (), require_sanity: bool = True
) -> list[GateFailure]:
    """What the platform itself refuses for a move of `alias` to the candidate, whatever the
    model's gates say: a failed latest run of any evaluator, a NaN or Inf weight, and for
    `production` (with `require_sanity`) no sanity evaluation at all. `gated`: the failures the
    model's own gates found, which are not repeated."""
    if alias not in GATED_ALIASES:
        return []
    sanity = EvaluatorName.SANITY.value
    ran_sanity = sanity in candidate.platform or sanity in candidate.errors
    found = evaluate_gates([SANITY_GATE] if ran_sanity else [], candidate.platform, None, errors=candidate.errors)
    if not ran_sanity and alias == AliasName.PRODUCTION and require_sanity:
        reason = "production takes only a version a platform sanity evaluation has passed, and none has run"
        found.append(GateFailure(metric=SANITY_GATE.metric, evaluator=sanity, reason=reason, value=None, max=0))
    for evaluator, error in sorted(candidate.errors.items()):
        if evaluator != sanity:  # the sanity gate above already names a failed sanity run
            reason = f"the latest {evaluator} evaluation failed: {error}"
            found.append(GateFailure(metric=None, evaluator=evaluator, reason=reason, value=None))
    # What the model's gates said already is not said twice (a gate on the same metric, or any
    # gate of an evaluator whose run failed).
    said = {(f.metric, f.evaluator, f.reason) for f in gated} | {(None, f.evaluator, f.reason) for f in gated}
    return [f for f in found if (f.metric, f.evaluator, f.reason) not in said]


def walk_ancestors(start: str, parent_of: Callable[[str], str | None], *, limit: int = MAX_LINEAGE_DEPTH) -> list[str]:
    """Parent, grandparent, ... of start (nearest first), stopping at an unknown parent or a cycle."""
    found: list[str] = []
    seen = {start}
    current = parent_of(start)
    while current is not None and current not in seen and len(found) < limit:
        found.append(current)
        seen.add(current)
        current = parent_of(current)
    return found


def walk_descendants(
    start: str, children_of: Callable[[list[str]], Mapping[str, list[str]]], *, limit: int = MAX_LINEAGE_DEPTH
) -> list[tuple[str, int]]:
    """(digest, depth) of every version descending from start, breadth first, each once."""
    found: list[tuple[str, int]] = []
    seen = {start}
    level, depth = [start], 0
    while level and depth < limit:
        depth += 1
        children = children_of(level)
        level = []
        for parent in sorted(children):
            for child in children[parent]:
                if child not in seen:
                    seen.add(child)
                    level.append(child)
                    found.append((child, depth))
    return found


# ---------------------------------------------------------------- over the control-plane DB


def version_row(session: Session, tenant_id: str, digest: str) -> ModelVersion | None:
    return session.exec(
        select(ModelVersion).where(col(ModelVersion.tenant_id) == tenant_id, col(ModelVersion.digest) == digest)
    ).first()


def version_with_content(session: Session, tenant_id: str, content_digest: str, key_id: str) -> ModelVersion | None:
    """The tenant's version holding these files and lineage signed by this key, whenever its
    manifest was built."""
    return session.exec(
        select(ModelVersion).where(
            col(ModelVersion.tenant_id) == tenant_id,
            col(ModelVersion.content_digest) == content_digest,
            col(ModelVersion.key_id) == key_id,
        )
    ).first()


def ancestors(session: Session, tenant_id: str, digest: str) -> list[ModelVersion]:
    rows: dict[str, ModelVersion] = {}

    def parent_of(current: str) -> str | None:
        row = rows.get(current) or version_row(session, tenant_id, current)
        if row is None:
            return None
        rows[current] = row
        return row.parent

    # parent_of has looked up every digest of the chain; one without a row (a corrupt index) is skipped.
    return [rows[d] for d in walk_ancestors(digest, parent_of) if d in rows]


def descendants(session: Session, tenant_id: str, digest: str) -> list[tuple[ModelVersion, int]]:
    rows: dict[str, ModelVersion] = {}

    def children_of(parents: list[str]) -> dict[str, list[str]]:
        found = session.exec(
            select(ModelVersion)
            .where(col(ModelVersion.tenant_id) == tenant_id, col(ModelVersion.parent).in_(parents))
            .order_by(col(ModelVersion.seq))
        ).all()
        children: dict[str, list[str]] = {}
        for row in found:
            rows[row.digest] = row
            if row.parent is not None:  # the query asked for children of named parents only
                children.setdefault(row.parent, []).append(row.digest)
        return children

    return [(rows[d], depth) for d, depth in walk_descendants(digest, children_of)]


def _active_keys(session: Session, tenant_id: str) -> list[SigningKey]:
    return list(
        session.exec(
            select(SigningKey).where(col(SigningKey.tenant_id) == tenant_id, col(SigningKey.revoked_at).is_(None))
        )
    )


def active_key_ids(session: Session, tenant_id: str) -> set[str]:
    return {key.key_id for key in _active_keys(session, tenant_id)}


def active_public_keys(session: Session, tenant_id: str) -> list[str]:
    """The tenant's registered, unrevoked public keys (hex)."""
    return sorted(key.public_key for key in _active_keys(session, tenant_id))


def keyring_for(session: Session, tenant_id: str) -> Keyring:
    """The tenant's registered, unrevoked public keys."""
    keyring = Keyring()
    for key in active_public_keys(session, tenant_id):
        keyring.trust(tenant_id, bytes.fromhex(key))
    return keyring


def gates_of(session: Session, model_id: str) -> list[GateSpec]:
    rows = session.exec(
        select(EvaluationGate).where(col(EvaluationGate.model_id) == model_id).order_by(col(EvaluationGate.metric))
    )
    return [GateSpec.of_row(g) for g in rows]


def model_by_id(session: Session, model_id: str) -> RegistryModel | None:
    return session.exec(select(RegistryModel).where(col(RegistryModel.id) == model_id)).first()


def evaluation_of(model: RegistryModel) -> EvaluationCommand | None:
    return EvaluationCommand.model_validate(model.evaluation) if model.evaluation else None


def results_of(session: Session, tenant_id: str, digests: list[str]) -> dict[str, VersionResults]:
    """Each version's evaluation records added up (latest result per metric, in recorded order,
    ties broken by record digest)."""
    found: dict[str, VersionResults] = {d: VersionResults() for d in digests}
    rows = session.exec(
        select(EvaluationResult)
        .where(col(EvaluationResult.tenant_id) == tenant_id, col(EvaluationResult.version).in_(digests))
        .order_by(col(EvaluationResult.recorded_at), col(EvaluationResult.record_digest))
    )
    for row in rows:
        results = found[row.version]
        if row.source != EvaluationSource.PLATFORM:
            results.reported.update(row.results)
        elif row.error is not None:
            results.errors[row.evaluator] = row.error
        else:
            results.errors.pop(row.evaluator, None)
            results.platform.setdefault(row.evaluator, {}).update(row.results)
    return found


def promotion_failures(
    session: Session, tenant_id: str, model_id: str, digest: str, *, alias: AliasName, require_sanity: bool = True
) -> list[GateFailure]:
    """The model's gates applied to the version's platform results, against the current
    production version's, then the platform's own (`platform_failures`)."""
    found = promotion_failures_of(
        session, tenant_id, model_id, [digest], aliases=[alias], require_sanity=require_sanity
    )
    return found[digest][alias]


def promotion_failures_of(
    session: Session,
    tenant_id: str,
    model_id: str,
    digests: list[str],
    *,
    aliases: Iterable[AliasName],
    require_sanity: bool = True,
) -> dict[str, dict[AliasName, list[GateFailure]]]:
    """`promotion_failures` of each version for each alias, reading the results, the gates and
    production once (a page of versions, each with its verdicts)."""
    production = session.exec(
        select(ModelAlias).where(col(ModelAlias.model_id) == model_id, col(ModelAlias.name) == AliasName.PRODUCTION)
    ).first()
    in_production = production.version if production is not None else None
    found = results_of(session, tenant_id, list(dict.fromkeys([*digests, *([in_production] if in_production else [])])))
    gates = gates_of(session, model_id)
    verdicts: dict[str, dict[AliasName, list[GateFailure]]] = {}
    for digest in digests:
        baseline = in_production if in_production != digest else None
        candidate = found[digest]
        gated = evaluate_gates(
            gates, candidate.platform, found[baseline].platform if baseline else None, errors=candidate.errors
        )
        verdicts[digest] = {
            alias: gated + platform_failures(alias, candidate, gated=gated, require_sanity=require_sanity)
            for alias in aliases
        }
    return verdicts


def missing_chunks(store: ChunkStore, chunk_ids: Iterable[str]) -> list[str]:
    """The ids (in the order given, each once) that the store does not hold."""
    unique = list(dict.fromkeys(chunk_ids))
    with ThreadPoolExecutor(max_workers=CHUNK_CHECK_CONCURRENCY) as pool:
        present = list(pool.map(store.has, unique))
    return [chunk_id for chunk_id, has in zip(unique, present, strict=True) if not has]


def publish_versions(session: Session, tenant_id: str, rows: list[ModelVersion]) -> list[ModelVersionPublic]:
    """Public views of version rows, with their model's name, their aliases and merged metrics."""
    model_ids = {row.model_id for row in rows}
    names = {m.id: m.name for m in session.exec(select(RegistryModel).where(col(RegistryModel.id).in_(model_ids)))}
    aliases: dict[tuple[str, str], list[str]] = {}
    for alias in session.exec(
        select(ModelAlias).where(col(ModelAlias.model_id).in_(model_ids)).order_by(col(ModelAlias.name))
    ):
        aliases.setdefault((alias.model_id, alias.version), []).append(alias.name)
    found = results_of(session, tenant_id, [row.digest for row in rows])
    return [
        ModelVersionPublic(
            **row.model_dump(),
            model=names[row.model_id],
            metrics=found[row.digest].metrics,
            reported_metrics=found[row.digest].reported,
            aliases=aliases.get((row.model_id, row.digest), []),
        )
        for row in rows
    ]


def publish_models(session: Session, models: list[RegistryModel]) -> list[ModelPublic]:
    ids = [m.id for m in models]
    aliases: dict[str, list[ModelAliasPublic]] = {}
    for alias in session.exec(
        select(ModelAlias).where(col(ModelAlias.model_id).in_(ids)).order_by(col(ModelAlias.name))
    ):
        aliases.setdefault(alias.model_id, []).append(ModelAliasPublic.model_validate(alias, from_attributes=True))
    return [
        ModelPublic(
            **m.model_dump(include={"id", "name", "description", "created_at"}),
            aliases=aliases.get(m.id, []),
            gates=gates_of(session, m.id),
            evaluation=evaluation_of(m),
        )
        for m in models
    ]


def replace_gates(session: Session, model: RegistryModel, gates: list[GateSpec]) -> None:
    session.exec(sa.delete(EvaluationGate).where(col(EvaluationGate.model_id) == model.id))
    session.add_all(gate.row(model.id) for gate in gates)
