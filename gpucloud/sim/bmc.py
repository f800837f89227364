"""The simulated fleet's BMCs: the sushy-tools Redfish emulator, one system per simulated node.

`gpucloud up` and the tests run it as its own process (`sushy-emulator --fake`, through
`entrypoints/bmc_emulator.py`) on loopback,
with HTTP basic auth (an htpasswd file with a bcrypt hash of a password kept in the data dir;
the control plane reads it through the credential reference `sim-bmc`). Its fake systems driver
keeps each system's power state in `<data dir>/bmc/state` and, like hardware, applies a power
change 1 to 11 seconds after it was asked for (on the next read after that; the demo and the
tests narrow that with `bmc.emulator_power_delay_s`).

The simulated fleet and the emulator agree through the emulator's external notifier: every
change of a system (a pending power change, then the change itself) is PUT to the simulated
fleet's `/v1/bmc/notify` (`sim/fleet.py`), which powers the node's simulated host off (its agent
stops answering and heartbeating) or boots it (after a boot delay, a new boot id, heartbeats
again). A system's name is its node id; its id on the BMC is a UUID derived from the node id.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gpucloud import children
from gpucloud.config import load_or_create_secret, write_private
from gpucloud.web import tls
from gpucloud.web.http_client import http_client

CREDENTIAL_REF = "sim-bmc"
USERNAME = "admin"
_NAMESPACE = uuid.UUID("6b1d6f3e-2b8a-4a3e-9a57-1f0c5f1a9b00")


def system_id_of(node_id: str) -> str:
    return str(uuid.uuid5(_NAMESPACE, node_id))


def sim_bmc_password(data_dir: Path) -> str:
    return load_or_create_secret(data_dir / "bmc" / "password", lambda: secrets.token_urlsafe(18))


def write_sim_credential(data_dir: Path, credentials_dir: Path) -> None:
    """The `sim-bmc` credential reference, as the control plane reads it."""
    write_private(credentials_dir / CREDENTIAL_REF, f"{USERNAME}:{sim_bmc_password(data_dir)}")


@dataclass
class BmcEmulator:
    """The emulator's configuration and process."""

    data_dir: Path
    port: int
    node_ids: list[str]
    notify_url: str | None = None
    host: str = "127.0.0.1"
    # A power change applies this many seconds (low, high) after it was asked for.
    power_delay_s: tuple[int, int] = (1, 11)
    process: subprocess.Popen | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def directory(self) -> Path:
        return self.data_dir / "bmc"

    def write_config(self) -> Path:
        import bcrypt

        self.directory.mkdir(parents=True, exist_ok=True)
        password = sim_bmc_password(self.data_dir).encode()
        htpasswd = self.directory / "htpasswd"
        write_private(htpasswd, f"{USERNAME}:{bcrypt.hashpw(password, bcrypt.gensalt(rounds=6)).decode()}\n")
        systems = [
            {
                "uuid": system_id_of(node_id),
                "name": node_id,
                "power_state": "On",
                "external_notifier": self.notify_url is not None,
                "nics": [],
            }
            for node_id in self.node_ids
        ]
        # The emulator reads its configuration as Python: every value written as a Python literal.
        lines = [
            "SUSHY_EMULATOR_FAKE_DRIVER = True",
            f"SUSHY_EMULATOR_STATE_DIR = {str(self.directory / 'state')!r}",
            f"SUSHY_EMULATOR_AUTH_FILE = {str(htpasswd)!r}",
            f"SUSHY_EMULATOR_FAKE_SYSTEMS = {systems!r}",
            f"EXTERNAL_NOTIFICATION_URL = {(self.notify_url or 'http://127.0.0.1:9')!r}",
        ]
        config = self.directory / "emulator.conf"
        write_private(config, "\n".join(lines) + "\n")
        return config

    def start(self, *, log_path: Path | None = None, wait_s: float = 30.0) -> None:
        config = self.write_config()
        log = open(log_path or self.directory / "emulator.log", "ab")  # noqa: SIM115 - the process writes it
        argv = [sys.executable, "-m", "gpucloud.entrypoints.bmc_emulator"]
        argv += ["--power-delay", *map(str, self.power_delay_s), "--config", str(config), "--fake"]
        argv += ["--interface", self.host, "--port", str(self.port)]
        # SIGTERM when the fleet that started it dies, however it dies (uvicorn re-raises SIGTERM
        # after its shutdown, so no `finally` runs).
        self.process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ}, **children.popen_kwargs()
        )
        log.close()
        deadline = time.monotonic() + wait_s
        with http_client(timeout="bmc", timeout_s=2.0, trust=tls.client_verify()) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the Redfish emulator exited with {self.process.returncode}: see {log.name}")
                try:
                    if client.get(f"{self.url}/redfish/v1/").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the Redfish emulator did not answer on {self.url} within {wait_s:.0f} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None
