"""The agent's side of a re-image's enrollment (`services/agent_enrollment.py`).

After the control plane booted the node from its clean image through the BMC and checked what
booted, it inserts a config drive (a second virtual medium) holding a one-time enrollment token.
The clean image mounts the drive and places its document at `--enrollment-file`; the agent reads
it, redeems the token at the API for the node's new credential, and keeps that (0600, the
credential file) as a wipe's credential is kept. Each drive is redeemed once: a token already
tried is not sent again (the API would refuse it), so an agent restarted with the drive still
inserted reports with the credential it kept. An agent started by a re-imaged boot may therefore
start with no credential at all: it reports nothing until the drive's token is redeemed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from pathlib import Path

import httpx

from gpucloud.agent.host import HostState
from gpucloud.protocol.reporter import ReportClient

log = logging.getLogger(__name__)


class ConfigDriveEnroller:
    def __init__(self, state: HostState, path: Path, reports: ReportClient) -> None:
        self.state, self.path, self.reports = state, path, reports
        self._tried: str | None = None  # the digest of the last token sent (sent once)

    async def once(self) -> bool:
        """Redeem the drive's token if there is a new one; whether the credential changed."""
        try:
            text = await asyncio.to_thread(self.path.read_text, encoding="utf-8")
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("the config drive at %s is unreadable: %s", self.path, exc)
            return False
        try:
            drive = json.loads(text)
            token, node_id = str(drive["enrollment_token"]), str(drive["node_id"])
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("the config drive at %s is not an enrollment document: %s", self.path, exc)
            return False
        digest = hashlib.sha256(token.encode()).hexdigest()
        if digest == self._tried:
            return False
        if node_id != self.state.node_id:
            log.error("the config drive is for node %s, not %s: not redeemed", node_id, self.state.node_id)
            self._tried = digest
            return False
        try:
            answer = await self.reports.enroll(token)
        except httpx.HTTPError as exc:  # the API is down: tried again at the next turn
            log.warning("enrollment not delivered (tried again): %s", exc)
            return False
        if answer.status_code >= 500:  # the API could not answer now: tried again at the next turn
            log.warning("enrollment not answered (%d, tried again): %s", answer.status_code, answer.text[:300])
            return False
        self._tried = digest
        if answer.status_code != 200:
            log.error("enrollment refused (%d): %s", answer.status_code, answer.text[:300])
            return False
        credential = answer.json()["credential"]
        await asyncio.to_thread(self.state.take_credential, credential)
        log.info("enrolled from the config drive: reporting with the node's new credential")
        return True
