"""The worker process (`gpucloud worker`): the control plane's Temporal worker, assembled by
`gpucloud.workers.main` from the adapters `gpucloud.bootstrap` makes, or the evaluation worker
(`gpucloud.workers.evaluation`, which loads none of them: it runs tenants' commands), run until
SIGINT or SIGTERM (which drain it: `temporal.worker_drain_s`)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

from gpucloud.config import Settings


def serve(settings: Settings, *, evaluation: bool = False) -> None:
    """Run the control plane's worker, or (`evaluation`) the evaluation worker, until stopped."""
    run: Callable[..., Awaitable[None]]
    if evaluation:
        from gpucloud.web import tls
        from gpucloud.workers.evaluation import run_evaluation_worker as run

        tls.trust(settings.tls.ca_file)  # as `bootstrap.trust_configured_ca`, without the control plane
    else:
        from gpucloud import bootstrap
        from gpucloud.workers.main import run_worker as run

        bootstrap.trust_configured_ca(settings)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run(settings, stop=stop)

    asyncio.run(main())
