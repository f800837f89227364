"""The evaluation worker (`gpucloud worker --role evaluation`): `EvaluationRunner` on the
evaluation task queue and nothing else, in a process of its own started with settings that hold
no platform secret (`Settings.for_evaluation_worker`): code a tenant wrote never runs in a
process that holds one (it refuses to start with one, `platform_secrets_in`).

It imports only what that takes (the Temporal client and the runner), not the control plane's
assembly in `workers/main.py`: the database, the issuer key's loaders and the adapters
`bootstrap` picks are never loaded into the process that runs tenants' commands.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from temporalio.client import Client
from temporalio.worker import Worker

from gpucloud.activities.evaluation_runner import EvaluationRunner
from gpucloud.adapters.temporal import connect_when_up
from gpucloud.config import Settings
from gpucloud.shared_secrets import PAYLOAD_KEYS, SHARED_SECRETS

log = logging.getLogger(__name__)


def build_evaluation_worker(client: Client, settings: Settings, *, executor: ThreadPoolExecutor) -> Worker:
    """The evaluation worker: `EvaluationRunner` on the evaluation task queue, and nothing else
    (it reads each version through the API, with the token its evaluation brings)."""
    runner = EvaluationRunner(work_dir=settings.evaluation_dir, registry=settings.registry)
    return Worker(
        client,
        task_queue=settings.temporal.evaluation_task_queue,
        activities=runner.all(),
        activity_executor=executor,
        max_concurrent_activities=settings.registry.evaluations_at_once,
        graceful_shutdown_timeout=timedelta(seconds=settings.temporal.worker_drain_s),
    )


def platform_secrets_in(settings: Settings) -> list[str]:
    """What of the platform's secrets `settings` hold, by variable (or the file it is kept in):
    the evaluation worker runs tenants' code, so it must be started with none of them
    (`Settings.for_evaluation_worker`, deploy/evaluations.env.example). The shared secrets are
    `shared_secrets.SHARED_SECRETS`' (all but the payload keys, which it needs), then the credentials
    of what it never reaches (databases, the object store, the fabric managers)."""
    held = []
    for secret in SHARED_SECRETS:
        if secret.name == PAYLOAD_KEYS:
            continue
        if secret.configured(settings) is not None:
            held.append(secret.variable)
        elif (path := secret.path(settings)).exists():
            held.append(str(path))
    if settings.api_delegate_path.exists():  # mints ledger tokens
        held.append(str(settings.api_delegate_path))
    credentials = (
        ("GPUCLOUD_DATABASE__URL", settings.database.url),
        ("GPUCLOUD_LEDGER__DATABASE_URL", settings.ledger.database_url),
        ("GPUCLOUD_OBJECT_STORE__SECRET_ACCESS_KEY", settings.object_store.secret_access_key),
        ("GPUCLOUD_FABRIC__UFM_TOKEN", settings.fabric.ufm_token),
        ("GPUCLOUD_FABRIC__NMX_TOKEN", settings.fabric.nmx_token),
        ("GPUCLOUD_FABRIC__VPC_TOKEN", settings.fabric.vpc_token),
    )
    return held + [variable for variable, value in credentials if value is not None]


async def run_evaluation_worker(settings: Settings, *, stop: asyncio.Event | None = None) -> None:
    if held := platform_secrets_in(settings):
        raise SystemExit(
            "the evaluation worker runs tenants' code and must hold none of the platform's secrets, but it was "
            f"given {', '.join(held)}: start it with its own environment and data dir "
            "(deploy/evaluations.env.example, gpucloud-evaluations.service)"
        )
    client = await connect_when_up(settings)
    with ThreadPoolExecutor(
        max_workers=settings.registry.evaluations_at_once, thread_name_prefix="evaluation"
    ) as executor:
        async with build_evaluation_worker(client, settings, executor=executor):
            log.info("evaluation worker running on %s", settings.temporal.evaluation_task_queue)
            await (stop.wait() if stop else asyncio.Event().wait())
