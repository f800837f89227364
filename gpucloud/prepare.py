"""`gpucloud prepare`: everything a deployment needs before its processes start, made where it
is missing and left alone where it is present, so the step is safe to run again (and on each
release, in place of `gpucloud migrate`).

Each item reports `created`, `present` or `refused` (with the reason); nothing here prints a
secret, only where it lives. The items, in order:
- the control-plane and ledger schemas (`db.migrate`, `ledger.db`);
- the shared secrets: the issuer key and the others each process would otherwise create in its
  own data dir on first use (`config.Settings`), which several hosts must share, and the API's
  delegate of the issuer key (issued again when it ends within a week);
- the Temporal namespace and the search attributes the workflows set (`models.search_attributes`);
- the object store: the S3 bucket, or the local store's directory, and that it answers;
- a default price book in the ledger (`ledger.pricebook.list_price_book`), written through the
  ledger's own price-book rules on its database, so no ledger process need run yet.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from google.protobuf.duration_pb2 import Duration
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest, RegisterNamespaceRequest
from temporalio.service import RPCError, RPCStatusCode

from gpucloud import bootstrap
from gpucloud.config import Settings
from gpucloud.models import search_attributes
from gpucloud.retry import Backoff, retry_call_async
from gpucloud.shared_secrets import SHARED_SECRETS, SharedSecret

Outcome = Literal["created", "present", "refused"]


@dataclass(frozen=True)
class Item:
    name: str
    outcome: Outcome
    detail: str


class Refused(Exception):
    """An item that cannot be prepared; the message says why and what to do."""


def prepare_secret(settings: Settings, secret: SharedSecret) -> Item:
    if secret.configured(settings) is not None:
        return Item(secret.name, "present", f"from {secret.variable}")
    path = secret.path(settings).resolve()
    existed = path.exists()
    secret.make(settings)
    where = f"{path} (0600; or set {secret.variable})"
    return Item(secret.name, "present" if existed else "created", where)


# A delegate with less than this left is issued again (its API processes take it at restart).
DELEGATE_RENEW_WITHIN_S = 7 * 86400


def prepare_api_delegate(settings: Settings) -> Item:
    """The API's delegate of the issuer key (`bootstrap.issue_api_delegate`): what an API process
    signs ledger tokens with. Issued where it is missing, or ends within a week."""
    import time

    import jwt

    from gpucloud.web import service_tokens

    path = settings.api_delegate_path
    where = f"{path} (0600): copy it to every API host; the issuer key stays here"
    if path.exists():
        try:
            certificate = service_tokens.load_delegate(path).certificate or ""
            left_s = jwt.decode(certificate, options={"verify_signature": False})["exp"] - time.time()
        except (ValueError, KeyError, jwt.PyJWTError):
            left_s = 0.0
        if left_s > DELEGATE_RENEW_WITHIN_S:
            return Item("API delegate", "present", f"{where}; valid {left_s / 86400:.0f} more days")
    bootstrap.issue_api_delegate(settings)
    days = bootstrap.API_DELEGATE_TTL_S / 86400
    taken_up = "running API processes take it up within seconds"
    return Item("API delegate", "created", f"{where}; valid {days:.0f} days ({taken_up})")


def prepare_schemas(settings: Settings, *, ledger: bool) -> list[Item]:
    from gpucloud.db import Database
    from gpucloud.ledger.db import LedgerDatabase

    databases: list[tuple[str, Any]] = [("control-plane schema", Database(settings.database_url))]
    if ledger:
        databases.append(("ledger schema", LedgerDatabase(settings.ledger_database_url)))
    items = []
    for name, database in databases:
        before, head = database.revisions()
        if before == head:
            items.append(Item(name, "present", f"revision {head}"))
            continue
        database.migrate()
        items.append(Item(name, "created", f"migrated from revision {before} to {head}"))
    return items


# A namespace registered a moment ago is not yet in every frontend's cache: adding its search
# attributes is refused with NOT_FOUND until it is (seconds; the dev server's cache refreshes
# every few seconds, a cluster's about every 10 s).
NAMESPACE_VISIBLE_S = 30.0


async def prepare_temporal(settings: Settings) -> list[Item]:
    namespace = settings.temporal.namespace
    client = await bootstrap.temporal_client(settings, wait_s=10.0)
    items = []
    try:
        await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace=namespace))
        items.append(Item("Temporal namespace", "present", namespace))
    except RPCError as exc:
        if exc.status != RPCStatusCode.NOT_FOUND:
            raise
        retention = Duration(seconds=int(settings.temporal.namespace_retention_s))
        await client.workflow_service.register_namespace(
            RegisterNamespaceRequest(namespace=namespace, workflow_execution_retention_period=retention)
        )
        items.append(Item("Temporal namespace", "created", f"{namespace} (retention {retention.seconds // 86400} d)"))
    wanted = {key.name: IndexedValueType.ValueType(key.indexed_value_type) for key in search_attributes.ALL}

    async def add_missing() -> dict[str, Any]:
        listed = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=namespace))
        present = listed.custom_attributes
        wrong = {n for n, t in wanted.items() if n in present and present[n] != t}
        if wrong:
            raise Refused(f"{', '.join(sorted(wrong))} exist(s) in {namespace} with another type than Keyword")
        missing = {n: t for n, t in wanted.items() if n not in present}
        if missing:
            await client.operator_service.add_search_attributes(
                AddSearchAttributesRequest(namespace=namespace, search_attributes=missing)
            )
        return missing

    # A namespace just registered is NOT_FOUND here until the server sees it: ask every half second.
    missing = await retry_call_async(
        add_missing,
        retry_on=lambda exc: isinstance(exc, RPCError) and exc.status == RPCStatusCode.NOT_FOUND,
        backoff=Backoff(first_s=0.5, cap_s=0.5),
        attempts=None,
        deadline_s=NAMESPACE_VISIBLE_S,
    )
    names = ", ".join(sorted(wanted))
    items.append(Item("search attributes", "created" if missing else "present", names))
    return items


def prepare_object_store(settings: Settings) -> Item:
    store = settings.object_store
    if store.backend != "s3":
        directory = settings.object_store_dir
        existed = directory.is_dir()
        directory.mkdir(parents=True, exist_ok=True)
        return Item("object store", "present" if existed else "created", f"directory {directory}")
    from botocore.exceptions import BotoCoreError, ClientError

    assert store.bucket is not None  # the settings refuse s3 without one
    s3 = bootstrap.s3_client(settings)
    where = f"bucket {store.bucket} at {store.endpoint_url or 'AWS S3'}"
    try:
        s3.head_bucket(Bucket=store.bucket)
        return Item("object store", "present", where)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket"):
            raise Refused(f"{where}: {exc}") from exc
    except BotoCoreError as exc:
        raise Refused(f"{where} does not answer: {exc} (GPUCLOUD_OBJECT_STORE__ENDPOINT_URL)") from exc
    created: dict[str, Any] = {"Bucket": store.bucket}
    if store.region and store.region != "us-east-1":  # S3 refuses the constraint for us-east-1
        created["CreateBucketConfiguration"] = {"LocationConstraint": store.region}
    s3.create_bucket(**created)
    s3.head_bucket(Bucket=store.bucket)  # it answers for the bucket it made
    return Item("object store", "created", where)


def prepare_price_book(settings: Settings) -> Item:
    from gpucloud.ledger import pricebook, problems
    from gpucloud.ledger.app import wall_clock_ms
    from gpucloud.ledger.db import open_ledger_database

    database = open_ledger_database(settings.ledger_database_url, migrate_on_start=False)
    try:
        with database.write() as connection:
            if pricebook.list_versions(connection):
                return Item("price book", "present", "list prices (models/catalog.py)")
            pricebook.create_version(connection, pricebook.list_price_book(), now_ms=wall_clock_ms())
    except problems.LedgerProblem as exc:  # a version made meanwhile, by another `prepare`
        if exc.problem.status != 409:
            raise
        return Item("price book", "present", "list prices (models/catalog.py)")
    finally:
        database.dispose()
    return Item("price book", "created", "list prices (models/catalog.py)")


def prepare(settings: Settings, *, ledger: bool = True) -> list[Item]:
    """Prepare every item, in order; an item that fails is `refused` and the next ones still run,
    except those that need it (no price book without the ledger's schema)."""
    items: list[Item] = []

    def attempt(name: str, step: Callable[[], Item | list[Item]]) -> bool:
        try:
            done = step()
        except Exception as exc:  # reported as refused, with its reason: the step's whole point
            reason = str(exc) if isinstance(exc, Refused) else f"{type(exc).__name__}: {exc}"
            items.append(Item(name, "refused", reason))
            return False
        items.extend(done if isinstance(done, list) else [done])
        return True

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    schemas = attempt("schemas", lambda: prepare_schemas(settings, ledger=ledger))
    for secret in SHARED_SECRETS:  # each one, even after one is refused
        attempt(secret.name, lambda secret=secret: prepare_secret(settings, secret))  # type: ignore[misc]
    attempt("API delegate", lambda: prepare_api_delegate(settings))
    attempt("Temporal", lambda: asyncio.run(prepare_temporal(settings)))
    attempt("object store", lambda: prepare_object_store(settings))
    if ledger:
        if schemas:  # written to the ledger's database directly: the schema is all it needs
            attempt("price book", lambda: prepare_price_book(settings))
        else:
            items.append(Item("price book", "refused", "needs the ledger's schema (above)"))
    return items
