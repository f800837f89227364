"""The simulated hosts' power, as their BMCs (the Redfish emulator, `sim/bmc.py`) say.

The emulator PUTs every change of a system to `/v1/bmc/notify` (its external notifier): first
the power change it was asked for, pending until its apply time, then the change itself. A
pending change is read back from the emulator at its apply time (the emulator applies changes
when a system is read), so it happens whether or not the control plane is polling.

- Off: the host stops; its agent answers nothing and sends no heartbeat; the tenant's
  processes are gone (the disks keep their data).
- On, from off: the host boots for `boot_s` seconds, then its agent is back with a new boot id
  and no workload. A power cycle also clears what a reboot clears: a hung host, and a hardware
  fault a reboot fixes. A boot with an image in the system's virtual CD (the emulator fetched
  it at insert and names its copy in the system's `boot_image`) boots that image: the agent
  reports its sha256 (`image_digest`); a boot without one reports none.
- A config drive in the system's virtual floppy (the emulator fetched it from the API at insert,
  with the node's one-time enrollment token as its basic credentials) is read by the booted
  image's agent, which redeems the token at the API for the node's new agent credential
  (`services/agent_enrollment.py`). A stand-in agent the tenant left behind never boots, so it
  never sees one: the control plane inserts the drive only after the booted image checked out.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from gpucloud.protocol.actions import AgentAction
from gpucloud.protocol.reporter import ReportClient
from gpucloud.retry import Backoff, retry_call_async
from gpucloud.sim.bmc import CREDENTIAL_REF, USERNAME, system_id_of
from gpucloud.sim.nodes import Fleet, SimNode
from gpucloud.web import tls
from gpucloud.web.http_client import async_http_client

log = logging.getLogger(__name__)

# A simulated node's calls (to the API, to its BMC): five tries, a second apart.
TRIES = 5
BETWEEN_TRIES = Backoff(first_s=1.0, cap_s=1.0)


@dataclass(frozen=True)
class BmcLink:
    url: str
    password: str
    boot_s: float = 3.0
    credential_ref: str = CREDENTIAL_REF


class SimPower:
    def __init__(self, fleet: Fleet, link: BmcLink) -> None:
        self.fleet = fleet
        self.link = link
        self._tasks: set[asyncio.Task] = set()
        self.powered_off: set[str] = set()
        self.boot_media: dict[str, str] = {}  # node id -> the emulator's copy of its inserted CD
        self.config_drives: dict[str, str] = {}  # node id -> its config drive's copy, once redeemed

    def inventory_fields(self, node_id: str) -> dict:
        return {
            "bmc_url": self.link.url,
            "bmc_system_id": system_id_of(node_id),
            "bmc_credential_ref": self.link.credential_ref,
        }

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def notified(self, system: dict) -> None:
        node = self.fleet.nodes.get(str(system.get("name")))
        if node is None:
            return
        path, _, inserted = ((system.get("boot_image") or {}).get("Cd") or (None, False, False))[:3]
        if inserted and path and system.get("boot_device") == "Cd":  # else it boots its disk
            self.boot_media[node.id] = str(path)
        else:
            self.boot_media.pop(node.id, None)
        drive, _, drive_in = ((system.get("boot_image") or {}).get("Floppy") or (None, False, False))[:3]
        if drive_in and drive and self.config_drives.get(node.id) != drive and node.id not in self.powered_off:
            self.config_drives[node.id] = str(drive)
            self._spawn(self._enroll(node, str(drive)))
        pending = system.get("pending_power")
        if pending:
            self._spawn(self._read_at(node, float(pending.get("apply_time", time.time()))))
        state = system.get("power_state")
        if state == "Off" and node.id not in self.powered_off:
            self._power_off(node)
        elif state == "On" and node.id in self.powered_off:
            self._spawn(self._boot(node))

    def _power_off(self, node: SimNode) -> None:
        self.powered_off.add(node.id)
        node.unreachable = True
        node.workload_running = False
        log.info("%s powered off", node.id)

    async def _boot(self, node: SimNode) -> None:
        await asyncio.sleep(self.link.boot_s)
        if node.id not in self.powered_off:
            return
        self.powered_off.discard(node.id)
        Fleet._repair(node, AgentAction.REBOOT)  # a new boot id, nothing running, what a reboot fixes is fixed
        node.image_digest = _digest(self.boot_media.get(node.id))
        node.unreachable = False
        log.info("%s booted (boot %d)", node.id, node.boot_id)

    async def _enroll(self, node: SimNode, drive: str) -> None:
        """The booted image's agent reads its config drive and redeems the one-time token there
        for the node's new credential (a few tries while the API is unreachable)."""
        try:
            config = json.loads(await asyncio.to_thread(Path(drive).read_text, encoding="utf-8"))
            token, api_url = str(config["enrollment_token"]), str(config["api_url"])
        except (OSError, ValueError, KeyError) as exc:
            log.warning("%s: the config drive %s is unreadable: %s", node.id, drive, exc)
            return

        async def redeem() -> httpx.Response:
            async with async_http_client(timeout="agent_lookup", trust=tls.client_verify()) as client:
                return await ReportClient(client, api_url).enroll(token)

        def not_delivered(exc: BaseException, _delay_s: float = 0.0) -> None:
            log.warning("%s: enrollment not delivered: %s", node.id, exc)

        try:
            answer = await retry_call_async(
                redeem,
                retry_on=httpx.HTTPError,
                backoff=BETWEEN_TRIES,
                attempts=TRIES,
                deadline_s=None,
                on_retry=not_delivered,
            )
        except httpx.HTTPError as exc:
            not_delivered(exc)
            return
        if answer.status_code == 200:
            node.credential, node.credential_from = answer.json()["credential"], "config_drive"
            log.info("%s enrolled from its config drive", node.id)
            return
        log.warning("%s: enrollment refused (%d): %s", node.id, answer.status_code, answer.text[:300])

    async def _read_at(self, node: SimNode, apply_time: float) -> None:
        """Read the system once its change is due: the emulator applies it and notifies again."""
        await asyncio.sleep(max(0.0, apply_time - time.time()) + 0.2)
        url = f"{self.link.url}/redfish/v1/Systems/{system_id_of(node.id)}"

        async def read() -> None:
            async with async_http_client(
                timeout="bmc", auth=(USERNAME, self.link.password), trust=tls.client_verify()
            ) as client:
                (await client.get(url)).raise_for_status()

        def failed(exc: BaseException, _delay_s: float = 0.0) -> None:
            log.warning("reading %s's system on the BMC failed: %s", node.id, exc)

        try:
            await retry_call_async(
                read, retry_on=httpx.HTTPError, backoff=BETWEEN_TRIES, attempts=TRIES, deadline_s=None, on_retry=failed
            )
        except httpx.HTTPError as exc:
            failed(exc)


def _digest(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as image:
            return "sha256:" + hashlib.file_digest(image, "sha256").hexdigest()
    except OSError:
        return None
