"""What every part of `gpucloud demo` shares: the callers (the operator's and each tenant's typed
API client, the simulated fleet's client), the bounded waits with a progress bar, and the one
error a part raises when the system does not behave as the demo expects."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import Progress, ProgressColumn

from gpucloud.cli.common import progress_bar
from gpucloud.client.api import ApiError, Gpucloud
from gpucloud.sim.client import SimFleetClient
from gpucloud.web.service_tokens import Issuer


class DemoFailed(RuntimeError):
    """The system did not do what the demo expects: what was expected, and what was seen."""


@dataclass
class Demo:
    console: Console
    api_url: str
    operator: Gpucloud
    sim: SimFleetClient
    _tenants: list[Gpucloud] = field(default_factory=list)

    @classmethod
    def connect(
        cls, console: Console, api_url: str, operator_token: str, sim_url: str, *, issuer: Issuer | None = None
    ) -> Demo:
        """`issuer`: the control plane's key, for the calls the fleet's agents take only from it."""
        operator = Gpucloud(api_url, operator_token, retry_for_s=30)
        return cls(console, api_url, operator, SimFleetClient(sim_url, issuer=issuer, token=operator_token))

    def tenant(self, api_key: str) -> Gpucloud:
        """The API as the tenant holding `api_key` sees it."""
        client = Gpucloud(self.api_url, api_key, retry_for_s=30)
        self._tenants.append(client)
        return client

    def close(self) -> None:
        self.sim.close()
        for client in (self.operator, *self._tenants):
            client.close()

    def progress(self, *extra: ProgressColumn) -> Progress:
        return progress_bar(self.console, *extra)

    def wait(self, what: str, total: int, done_count: Callable[[], int], *, timeout_s: float = 180) -> None:
        """A bar of `done_count()` out of `total`, polled until it is all done; DemoFailed after `timeout_s`."""
        with self.progress() as progress:
            task = progress.add_task(what, total=total)
            deadline = time.monotonic() + timeout_s
            while (done := done_count()) < total:
                progress.update(task, completed=done)
                if time.monotonic() > deadline:
                    raise DemoFailed(f"timed out after {timeout_s:.0f}s waiting: {what} ({done}/{total})")
                time.sleep(0.3)
            progress.update(task, completed=done)

    def stages(self, stages: list[tuple[str, Callable[[], Any]]], *, timeout_s: float) -> list[Any]:
        """One bar over the stages, each waited on in turn until it returns something; those values."""
        results = []
        with self.progress() as progress:
            task = progress.add_task(stages[0][0], total=len(stages))
            deadline = time.monotonic() + timeout_s
            for what, check in stages:
                progress.update(task, description=what)
                while not (value := check()):
                    if time.monotonic() > deadline:
                        raise DemoFailed(f"timed out after {timeout_s:.0f}s waiting: {what}")
                    time.sleep(0.2)
                results.append(value)
                progress.advance(task)
        return results


def refused(status: int, call: Callable[[], object], what: str) -> ApiError:
    """The API's refusal of `call`, which must answer `status`; DemoFailed if it did anything else."""
    try:
        call()
    except ApiError as error:
        if error.status == status:
            return error
        raise DemoFailed(f"{what}: expected HTTP {status}, got {error.status} ({error.detail})") from None
    raise DemoFailed(f"{what}: expected HTTP {status}, the call succeeded")
