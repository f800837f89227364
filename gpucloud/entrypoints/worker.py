"""The worker process (`gpucloud worker`): the control plane's Temporal worker, or the evaluation
worker, assembled by `gpucloud.workers.main` from the adapters `gpucloud.bootstrap` makes, run
until SIGINT or SIGTERM (which drain it: `temporal.worker_drain_s`)."""

from __future__ import annotations

import asyncio
import signal

from gpucloud import bootstrap
from gpucloud.config import Settings
from gpucloud.workers.main import run_evaluation_worker, run_worker


def serve(settings: Settings, *, evaluation: bool = False) -> None:
    """Run the control plane's worker, or (`evaluation`) the evaluation worker, until stopped."""
    bootstrap.trust_configured_ca(settings)
    run = run_evaluation_worker if evaluation else run_worker

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run(settings, stop=stop)

    asyncio.run(main())
