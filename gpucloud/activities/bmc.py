"""Activities that act on nodes out of band, through their BMCs (`adapters/bmc.py`).

Every call is recorded on the node: its power state, the BMC's last answer (`bmc_last`), and an
event in the node's history with that answer or the error. A BMC error that says the request
cannot succeed (wrong credentials, no such system, a power state that never follows) is final
(`BmcFailed`, non-retryable); an unreachable, slow or failing BMC is retried by Temporal within
`options.BMC`'s bounds, and after them the caller sees the last error. A node without a BMC is
not an error: the result says nothing was done, and the caller falls back to the agent.

Cleaning between tenants, the way Ironic cleans: the departing tenant had root on the node and
may have replaced its agent, so the node is not clean on its own word. `bmc_boot_image` inserts
the configured known image as virtual media with a one-time boot override and power-cycles the
node; the agent that answers afterwards reports its boot id and the digest of the image it
booted, and `bmc_check_image` accepts the node only on a new boot of exactly that image (else
the workflow fails it closed into `quarantined`). Only then does `bmc_hand_enrollment` hand out
a one-time enrollment token, through the image's configuration: a config drive in the system's
second virtual medium, which the BMC fetches from the API and the booted image's agent redeems
for the node's next credential (`services/agent_enrollment.py`); the old agent never sees it,
and the wipe that follows carries none. Without a BMC, virtual media or a configured image, the
in-band wipe alone cleans the node and hands the agent its next credential (`WipeRotation`),
and its events say that this is weaker; so does a BMC with no second medium for the drive.
"""

from __future__ import annotations

import time
from datetime import datetime

from temporalio import activity
from temporalio.exceptions import ApplicationError

from gpucloud.activities import ActivityGroup
from gpucloud.activities.heartbeats import beats_while_running
from gpucloud.adapters.bmc import POWER_AFTER, BmcError, Bmcs
from gpucloud.db import Database
from gpucloud.models.messages import (
    BmcPowerInput,
    BmcPowerResult,
    EnrollmentInput,
    EnrollmentResult,
    ImageCheckInput,
    ImageCheckResult,
    NodeRef,
)
from gpucloud.models.tables import Node, NodeTransition, utcnow
from gpucloud.services import agent_credentials
from gpucloud.services.agent_enrollment import EnrollmentTokens
from gpucloud.services.operations import settle
from gpucloud.workflows.options import BMC_ATTEMPTS


class BmcActivities(ActivityGroup):
    def __init__(
        self,
        db: Database,
        bmcs: Bmcs,
        *,
        boot_wait_s: float = 600.0,
        firmware_image_uri: str | None = None,
        clean_image: tuple[str | None, str | None] = (None, None),
        enrollment: EnrollmentTokens | None = None,
        config_drive_url: str | None = None,
    ) -> None:
        self.db = db
        self.bmcs = bmcs
        self.boot_wait_s = boot_wait_s
        # A re-imaged node's one-time enrollment, and the URL its BMC fetches the drive from.
        self.enrollment = enrollment
        self.config_drive_url = config_drive_url
        self.firmware_image_uri = firmware_image_uri
        self.clean_image_url, self.clean_image_sha256 = clean_image

    def _record(self, node_id: str, event: str, *, actor: str, cause: str, **changes) -> None:
        with self.db.session() as session:
            node = session.get(Node, node_id)
            if node is None:
                return
            for name, value in changes.items():
                setattr(node, name, value)
            node.updated_at = utcnow()
            session.add(node)
            session.add(NodeTransition.noted(node, event, cause=cause, actor=actor, at=utcnow()))

    def _endpoint(self, node_id: str) -> tuple[str, str, str] | None:
        with self.db.session() as session:
            node = session.get(Node, node_id)
            if node is None:
                raise ApplicationError(f"node {node_id} does not exist", type="NodeNotFound", non_retryable=True)
            return node.bmc_endpoint()

    def _failed(self, req_node: str, what: str, error: BmcError, *, actor: str) -> ApplicationError:
        last = {"at": utcnow().isoformat(), "action": what, "ok": False, "kind": error.kind, "answer": str(error)}
        self._record(req_node, f"bmc_{error.kind}", actor=actor, cause=f"{what}: {error}", bmc_last=last)
        return ApplicationError(
            f"BMC {what} failed ({error.kind}): {error}",
            error.kind,
            type="BmcFailed",
            non_retryable=not error.retryable,
        )

    @activity.defn
    @beats_while_running
    def bmc_power(self, req: BmcPowerInput) -> BmcPowerResult:
        """Power on, off or cycle (idempotent); optionally wait until the agent heartbeats again."""
        endpoint = self._endpoint(req.node_id)
        if endpoint is None:
            return BmcPowerResult(node_id=req.node_id, done=False, answer="the node has no BMC")
        started = utcnow()
        try:
            answer = self.bmcs.for_node(*endpoint).power(req.action)
        except BmcError as error:
            failure = self._failed(req.node_id, f"power {req.action}", error, actor=req.actor)
            if failure.non_retryable or activity.info().attempt >= BMC_ATTEMPTS:
                settle(self.db, req.operation_id, error=f"power {req.action}: {error}")
            raise failure from error
        state = POWER_AFTER[req.action]  # power() returns only once the BMC shows it
        last = {"at": utcnow().isoformat(), "action": f"power {req.action}", "ok": True, "answer": answer}
        cause = f"{req.cause}: BMC: {answer}" if req.cause else f"BMC: {answer}"
        self._record(req.node_id, f"power_{req.action}", actor=req.actor, cause=cause, power_state=state, bmc_last=last)
        if req.wait_for_agent and state == "On" and answer != "already on" and self._can_report(req.node_id):
            silent = self._wait_for_heartbeat(req.node_id, since=started)
            if silent is not None:
                self._record(req.node_id, "boot_timeout", actor=req.actor, cause=silent)
                settle(self.db, req.operation_id, error=silent)
                raise ApplicationError(silent, type="AgentDidNotReturn", non_retryable=True)
            answer += "; the agent heartbeats again"
        settle(self.db, req.operation_id, error=None)
        return BmcPowerResult(node_id=req.node_id, done=True, power_state=state, answer=answer)

    def _can_report(self, node_id: str) -> bool:
        """A node whose credential was revoked with its allocation cannot heartbeat until its
        next wipe: waiting for one would fail a boot that worked. The wipe that follows the power
        cycle reaches the agent, or fails, and says so."""
        with self.db.session() as session:
            return not agent_credentials.revoked(session, [node_id])

    def _wait_for_heartbeat(self, node_id: str, *, since: datetime) -> str | None:
        """None once the node's agent heartbeats after `since` (its host booted), else why not."""
        deadline = time.monotonic() + self.boot_wait_s
        while time.monotonic() < deadline:
            with self.db.session() as session:
                node = session.get(Node, node_id)
                if node is not None and node.last_heartbeat_at is not None and node.last_heartbeat_at > since:
                    return None
            activity.heartbeat("waiting for the agent's heartbeat")
            time.sleep(min(2.0, self.boot_wait_s / 10))
        return f"the node was powered on but its agent did not heartbeat within {self.boot_wait_s:.0f} s"

    @activity.defn
    @beats_while_running
    def bmc_discover(self, req: NodeRef) -> BmcPowerResult:
        """What the BMC reports about the node's system, merged into its record (`hardware`)."""
        endpoint = self._endpoint(req.node_id)
        if endpoint is None:
            return BmcPowerResult(node_id=req.node_id, done=False, answer="the node has no BMC")
        try:
            info = self.bmcs.for_node(*endpoint).system()
        except BmcError as error:
            raise self._failed(req.node_id, "discovery", error, actor="system") from error
        record = info.as_record()
        answer = ", ".join(f"{k}={v}" for k, v in record.items() if k not in ("system_id", "uuid"))
        last = {"at": utcnow().isoformat(), "action": "discovery", "ok": True, "answer": answer}
        self._record(
            req.node_id, "bmc_discovered", actor="system", cause=answer, hardware=record,
            power_state=info.power_state, bmc_last=last,
        )  # fmt: skip
        return BmcPowerResult(node_id=req.node_id, done=True, power_state=info.power_state, answer=answer)

    @activity.defn
    @beats_while_running
    def bmc_firmware_update(self, req: NodeRef) -> BmcPowerResult:
        """Install the configured firmware through the BMC's UpdateService (Redfish SimpleUpdate).
        Not done (the caller reflashes through the agent) without a BMC, without a configured
        image, or where the BMC offers no UpdateService for the system."""
        endpoint = self._endpoint(req.node_id)
        if endpoint is None or not self.firmware_image_uri:
            why = "the node has no BMC" if endpoint is None else "no firmware image is configured"
            return BmcPowerResult(node_id=req.node_id, done=False, answer=why)
        try:
            answer = self.bmcs.for_node(*endpoint).firmware_update(self.firmware_image_uri)
        except BmcError as error:
            if error.kind != "unsupported":
                raise self._failed(req.node_id, "firmware update", error, actor="system") from error
            self._record(req.node_id, "bmc_unsupported", actor="system", cause=f"{error}: the agent reflashes")
            return BmcPowerResult(node_id=req.node_id, done=False, answer=str(error))
        last = {"at": utcnow().isoformat(), "action": "firmware update", "ok": True, "answer": answer}
        self._record(req.node_id, "firmware_update", actor="system", cause=f"BMC: {answer}", bmc_last=last)
        return BmcPowerResult(node_id=req.node_id, done=True, answer=answer)

    @activity.defn
    @beats_while_running
    def bmc_boot_image(self, req: NodeRef) -> BmcPowerResult:
        """Boot the node once from the known clean image through its BMC: virtual media insert,
        one-time boot override, power cycle. Not done (recorded as the weaker in-band wipe)
        without a BMC or a configured image, or where the BMC refuses virtual media."""
        endpoint = self._endpoint(req.node_id)
        image = self.clean_image_url
        why = "the node has no BMC" if endpoint is None else None
        if why is None and (not image or not self.clean_image_sha256):
            why = "no clean image is configured (bmc.clean_image_url, bmc.clean_image_sha256)"
        inserted = ""
        if why is None and endpoint is not None and image:
            try:
                inserted = self.bmcs.for_node(*endpoint).boot_from_image(image)
            except BmcError as error:
                if error.kind != "unsupported":
                    raise self._failed(req.node_id, "virtual media boot", error, actor="system") from error
                why = str(error)
        if why is not None or endpoint is None:
            self._record(
                req.node_id, "inband_wipe_only", actor="system",
                cause=f"not re-imaged out of band ({why}): the in-band wipe alone is weaker, "
                "the agent that answers it may be the previous tenant's",
            )  # fmt: skip
            return BmcPowerResult(node_id=req.node_id, done=False, answer=str(why))
        last = {"at": utcnow().isoformat(), "action": "virtual media boot", "ok": True, "answer": inserted}
        self._record(req.node_id, "image_inserted", actor="system", cause=f"BMC: {inserted}", bmc_last=last)
        try:
            cycled = self.bmcs.for_node(*endpoint).power("cycle")
        except BmcError as error:
            raise self._failed(req.node_id, "power cycle", error, actor="system") from error
        last = {"at": utcnow().isoformat(), "action": "power cycle", "ok": True, "answer": cycled}
        self._record(
            req.node_id,
            "power_cycle",
            actor="system",
            cause=f"re-image: BMC: {cycled}",
            power_state="On",
            bmc_last=last,
        )
        return BmcPowerResult(node_id=req.node_id, done=True, power_state="On", answer=f"{inserted}; {cycled}")

    @activity.defn
    @beats_while_running
    def bmc_check_image(self, req: ImageCheckInput) -> ImageCheckResult:
        """Accept the boot `bmc_boot_image` caused only if the agent reports a new boot id and
        the clean image's digest; eject the image either way."""
        expected = f"sha256:{self.clean_image_sha256}"
        if not req.boot_id or req.boot_id == req.boot_id_before:
            why = f"the agent reports no new boot (boot id {req.boot_id!r}, before {req.boot_id_before!r})"
        elif req.image_digest != expected:
            why = f"the agent reports booting {req.image_digest!r}, not the clean image {expected}"
        else:
            why = None
        endpoint = self._endpoint(req.node_id)
        try:
            ejected = self.bmcs.for_node(*endpoint).eject_image() if endpoint is not None else "no BMC"
        except BmcError as error:  # the override was for one boot: a stuck CD is noted, not fatal
            ejected = f"eject failed: {error}"
        if why is None:
            answer = f"boot {req.boot_id} booted {expected}; {ejected}"
            self._record(req.node_id, "image_verified", actor=req.actor, cause=answer)
            return ImageCheckResult(node_id=req.node_id, ok=True, answer=answer)
        self._record(req.node_id, "image_mismatch", actor=req.actor, cause=f"{why}; {ejected}")
        return ImageCheckResult(node_id=req.node_id, ok=False, answer=why)

    @activity.defn
    def bmc_hand_enrollment(self, req: EnrollmentInput) -> EnrollmentResult:
        """After a checked re-image: hand out the node's one-time enrollment token in a config
        drive through its BMC, wait (bounded by `boot_wait_s`) until the booted image's agent
        redeemed it, and eject the drive. Not done (the wipe hands the credential in band,
        recorded as weaker) where the BMC has no second medium or nothing is configured; a token
        not redeemed in time is final (the node fails closed, and its repair re-images it)."""
        endpoint = self._endpoint(req.node_id)
        if endpoint is None or self.enrollment is None or not self.config_drive_url:
            why = "no enrollment through the BMC is configured"
            return EnrollmentResult(node_id=req.node_id, done=False, answer=why)
        with self.db.session() as session:
            handed = self.enrollment.hand_out(session, req.node_id, req.request_id)
        bmc = self.bmcs.for_node(*endpoint)
        try:
            inserted = bmc.insert_config_media(self.config_drive_url, username=req.node_id, password=handed.token)
        except BmcError as error:
            if error.kind != "unsupported":
                raise self._failed(req.node_id, "config drive insert", error, actor=req.actor) from error
            self._record(
                req.node_id, "enrollment_inband", actor=req.actor,
                cause=f"no config drive ({error}): the wipe hands the booted agent its credential in band, weaker",
            )  # fmt: skip
            return EnrollmentResult(node_id=req.node_id, done=False, answer=str(error))
        until = f"{handed.expires_at:%H:%M:%S}Z"
        cause = f"BMC: {inserted}: a one-time enrollment token for the booted image, until {until}"
        self._record(req.node_id, "enrollment_handed", actor=req.actor, cause=cause)
        redeemed = self._wait_for_redemption(req)
        try:
            ejected = bmc.eject_config_media()
        except BmcError as error:  # the token is spent or refused either way: noted, not fatal
            ejected = f"eject failed: {error}"
        if redeemed is None:
            why = f"the booted agent did not redeem its enrollment token within {self.boot_wait_s:.0f} s"
            self._record(req.node_id, "enrollment_timeout", actor=req.actor, cause=f"{why}; {ejected}")
            raise ApplicationError(why, type="AgentDidNotEnroll", non_retryable=True)
        answer = f"the booted agent redeemed its one-time enrollment token at {redeemed:%H:%M:%S}Z; {ejected}"
        self._record(req.node_id, "agent_enrolled", actor=req.actor, cause=answer)
        return EnrollmentResult(node_id=req.node_id, done=True, answer=answer)

    def _wait_for_redemption(self, req: EnrollmentInput) -> datetime | None:
        assert self.enrollment is not None
        deadline = time.monotonic() + self.boot_wait_s
        while True:
            with self.db.session() as session:
                redeemed = self.enrollment.redeemed(session, req.node_id, req.request_id)
            if redeemed is not None or time.monotonic() >= deadline:
                return redeemed
            activity.heartbeat("waiting for the booted agent to enroll")
            time.sleep(min(1.0, self.boot_wait_s / 10))
