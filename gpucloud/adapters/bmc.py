"""Nodes' BMCs over Redfish, through `sushy` (the client Ironic uses): the one client of BMCs.

A node's BMC is a Redfish service (`url`), the node's system on it (`system_id`, a member of
its Systems collection) and a credential reference the control plane resolves in its secrets
directory (`BmcCredentials`); the secret never sits in the node's row.

Every call is bounded (`timeout_s` per request, one attempt inside sushy) and every failure is a
`BmcError` with a kind that says whether trying again can help: `auth` (wrong credentials),
`not_found` (no such system), `bad_request` and `unsupported` are final; `unreachable`,
`timeout` and `server_error` (5xx, or an answer that is not Redfish) are worth retrying, and the
caller bounds how often. A BMC that accepts a power action but whose power state never follows
is `stuck` after `power_wait_s`.

Power actions are idempotent: `on` of a system that is on, or `off` of one that is off, sends
nothing. `cycle` is an explicit off, then on, each waited for, so a BMC that only pretends to
reset is caught at the first wait.

Re-imaging out of band (`boot_from_image`) inserts an image into the system's virtual CD (or
USB stick) through Redfish VirtualMedia and sets a one-time boot-source override to it; the next
power-on boots the image, not the disk the previous tenant had root on. Both are read back: a BMC
that answers 204 but keeps neither has not done it. A BMC without VirtualMedia, or whose media
cannot take the image, is `unsupported` (the caller falls back to an in-band wipe and says so).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from gpucloud.web.tls import is_loopback

if TYPE_CHECKING:  # sushy (and requests under it) load on the first call to a BMC, not at import:
    import sushy  # the API and the CLI import this module through the workflows and never call one

BmcErrorKind = Literal[
    "auth", "not_found", "bad_request", "unsupported", "unreachable", "timeout", "server_error", "stuck"
]
PowerAction = Literal["on", "off", "cycle"]
POWER_AFTER: dict[str, str] = {"on": "On", "off": "Off", "cycle": "On"}
_RETRYABLE = frozenset({"unreachable", "timeout", "server_error"})


class BmcError(Exception):
    def __init__(self, kind: BmcErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    @property
    def retryable(self) -> bool:
        return self.kind in _RETRYABLE


@dataclass(frozen=True)
class BmcEndpoint:
    """Where a node's BMC is and how to log in to it (resolved, in memory only)."""

    url: str
    system_id: str
    username: str
    password: str


@dataclass(frozen=True)
class SystemInfo:
    """What a BMC says about one system: merged into the node's record at enrollment."""

    system_id: str
    name: str | None
    power_state: str | None
    manufacturer: str | None
    model: str | None
    serial_number: str | None
    cpu_count: int | None
    memory_gib: float | None
    bios_version: str | None
    uuid: str | None

    def as_record(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if value is not None}


class BmcCredentials:
    """Credential references resolved from a directory: `<dir>/<ref>` holds `username:password`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def resolve(self, ref: str) -> tuple[str, str]:
        if not ref or "/" in ref or ref.startswith("."):
            raise BmcError("auth", f"credential reference {ref!r} is not a name in the credentials directory")
        try:
            username, _, password = (self.directory / ref).read_text().strip().partition(":")
        except OSError:
            raise BmcError(
                "auth", f"no BMC credential {ref!r}: put 'username:password' in {self.directory / ref} (0600)"
            ) from None
        return username, password


def require_tls(url: str, *, allow_insecure: bool) -> None:
    """Refuse a BMC reached in clear off loopback: the credential goes with every request."""
    parts = urlsplit(url)
    if parts.scheme == "https" or allow_insecure or (parts.scheme == "http" and is_loopback(parts.hostname or "")):
        return
    raise BmcError(
        "bad_request",
        f"BMC {url}: Redfish off loopback only over https:// (enroll the node with an https URL), "
        "or set GPUCLOUD_BMC__ALLOW_INSECURE=true on a management network you trust",
    )


def _translate(error: Exception, what: str) -> BmcError:
    """A sushy or transport failure as a `BmcError`."""
    from sushy import exceptions as sushy_errors

    if isinstance(error, BmcError):
        return error
    if isinstance(error, sushy_errors.AccessError):
        return BmcError("auth", f"{what}: the BMC refused the credentials (HTTP {error.status_code})")
    if isinstance(error, sushy_errors.ResourceNotFoundError):
        return BmcError("not_found", f"{what}: the BMC has no such system")
    if isinstance(error, sushy_errors.BadRequestError):
        return BmcError("bad_request", f"{what}: the BMC refused the request: {error.detail or error}")
    if isinstance(error, sushy_errors.ServerSideError):
        return BmcError("server_error", f"{what}: the BMC failed (HTTP {error.status_code})")
    if isinstance(error, sushy_errors.ConnectionError):
        text = str(error)
        kind: BmcErrorKind = "timeout" if "timed out" in text.lower() or "timeout" in text.lower() else "unreachable"
        return BmcError(
            kind, f"{what}: {'no answer in time' if kind == 'timeout' else 'cannot connect'} ({text[:200]})"
        )
    if isinstance(error, sushy_errors.SushyError):
        return BmcError("server_error", f"{what}: the BMC's answer is not valid Redfish ({str(error)[:200]})")
    return BmcError("server_error", f"{what}: {type(error).__name__}: {str(error)[:200]}")


class RedfishBmc:
    """One node's BMC."""

    def __init__(
        self,
        endpoint: BmcEndpoint,
        *,
        timeout_s: float = 10.0,
        power_wait_s: float = 120.0,
        poll_s: float = 1.0,
        verify: bool | str = True,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.power_wait_s = power_wait_s
        self.poll_s = poll_s
        self.verify = verify
        self._root: sushy.Sushy | None = None

    def _sushy(self) -> sushy.Sushy:
        if self._root is None:
            try:
                self._root = _connect(self.endpoint.url, self.endpoint.username, self.endpoint.password, self)
            except Exception as error:
                raise _translate(error, f"BMC {self.endpoint.url}") from error
        return self._root

    def _system(self):
        what = f"system {self.endpoint.system_id} on {self.endpoint.url}"
        try:
            return self._sushy().get_system(f"/redfish/v1/Systems/{self.endpoint.system_id}")
        except Exception as error:
            raise _translate(error, what) from error

    def system(self) -> SystemInfo:
        system = self._system()
        return _info(system)

    def power_state(self) -> str:
        return _power_state(self._system())

    def power(self, action: PowerAction) -> str:
        """Bring the system's power to what `action` asks and wait until it shows; returns what
        was done, in words (the BMC's answer for the node's events). Afterwards the power is
        `POWER_AFTER[action]`."""
        system = self._system()  # one read; the resets act on it, the waits read the state
        state = _power_state(system)
        if action == "on":
            return "already on" if state == "On" else self._reset(system, "On", want="On", was=state)
        if action == "off":
            return "already off" if state == "Off" else self._reset(system, "ForceOff", want="Off", was=state)
        steps = [] if state == "Off" else [self._reset(system, "ForceOff", want="Off", was=state)]
        steps.append(self._reset(system, "On", want="On", was="Off"))
        return "; ".join(steps)

    def _reset(self, system, reset_type: str, *, want: str, was: str) -> str:
        started = time.monotonic()
        try:
            from sushy import ResetType

            system.reset_system(ResetType(reset_type))
        except Exception as error:
            raise _translate(error, f"{reset_type} of system {self.endpoint.system_id}") from error
        deadline = started + self.power_wait_s
        state = was
        while time.monotonic() < deadline:
            state = self.power_state()
            if state == want:
                return f"{reset_type} accepted; power {was} -> {want} in {time.monotonic() - started:.1f} s"
            time.sleep(self.poll_s)
        raise BmcError(
            "stuck",
            f"the BMC accepted {reset_type} but the power state is still {state} after {self.power_wait_s:.0f} s",
        )

    def firmware_update(self, image_uri: str) -> str:
        """Redfish SimpleUpdate of the system's firmware; `unsupported` where the BMC has none."""
        root = self._sushy()
        try:
            service = root.get_update_service()
        except Exception as error:
            raise BmcError("unsupported", f"the BMC offers no UpdateService ({_translate(error, 'update')})") from error
        target = f"/redfish/v1/Systems/{self.endpoint.system_id}"
        try:
            service.simple_update(image_uri, targets=[target])
        except Exception as error:
            translated = _translate(error, f"SimpleUpdate of {target}")
            if translated.kind == "server_error":
                raise BmcError(
                    "unsupported", f"the BMC's UpdateService cannot update {target}: {translated}"
                ) from error
            raise translated from error
        return f"SimpleUpdate of {target} with {image_uri} accepted"

    def boot_from_image(self, image_url: str) -> str:
        """Insert `image_url` as virtual media and boot it once at the next power-on; the BMC's
        answer, in words, after reading both back."""
        system = self._system()
        media, target = self._boot_media(system)
        try:
            if media.inserted:  # BMCs refuse to insert over media (a retry finds its own there)
                media.eject_media()
            media.insert_media(image_url, inserted=True, write_protected=True)
            from sushy import BootSourceOverrideEnabled

            system.set_system_boot_options(target=target, enabled=BootSourceOverrideEnabled.ONCE)
            media.refresh(force=True)
            system.refresh(force=True)
        except BmcError:
            raise
        except Exception as error:
            translated = _translate(error, f"virtual media boot of {image_url}")
            if translated.kind in ("bad_request", "server_error"):
                raise BmcError("unsupported", f"the BMC's virtual media cannot boot the image: {translated}") from error
            raise translated from error
        if media.image != image_url or not media.inserted:
            raise BmcError("unsupported", f"the BMC accepted the insert but its {media.identity} holds {media.image!r}")
        boot_target = system.boot.target.value if system.boot.target is not None else None
        if boot_target != target.value:
            raise BmcError("unsupported", f"the BMC accepted the boot override but boots {boot_target!r}")
        enabled = system.boot.enabled.value if system.boot.enabled is not None else "not reported"
        return f"{image_url} inserted in {media.identity}; boot override {boot_target} ({enabled})"

    def eject_image(self) -> str:
        """Eject whatever `boot_from_image` inserted (nothing sent where nothing is inserted)."""
        media, _ = self._boot_media(self._system())
        if not media.inserted:
            return f"{media.identity} was empty"
        try:
            media.eject_media()
        except Exception as error:
            raise _translate(error, f"eject of {media.identity}") from error
        return f"{media.identity} ejected"

    def insert_config_media(self, url: str, *, username: str, password: str) -> str:
        """Insert `url` (a config drive) into the system's second virtual medium (a floppy or USB
        stick, not the CD the image boots from), fetched by the BMC with basic credentials; the
        BMC's answer, in words, after reading it back. `unsupported` where there is none."""
        system = self._system()
        media = self._config_media(system)
        try:
            if media.inserted:  # a retry's, or one left behind: replaced
                media.eject_media()
            media.insert_media(url, inserted=True, write_protected=True, username=username, password=password)
            media.refresh(force=True)
        except Exception as error:
            translated = _translate(error, f"virtual media insert of {url}")
            if translated.kind in ("bad_request", "server_error"):
                raise BmcError(
                    "unsupported", f"the BMC's virtual media cannot take the config drive: {translated}"
                ) from error
            raise translated from error
        if media.image != url or not media.inserted:
            raise BmcError("unsupported", f"the BMC accepted the insert but its {media.identity} holds {media.image!r}")
        return f"config drive inserted in {media.identity}"

    def eject_config_media(self) -> str:
        """Eject the config drive `insert_config_media` inserted (nothing sent where none is)."""
        media = self._config_media(self._system())
        if not media.inserted:
            return f"{media.identity} was empty"
        try:
            media.eject_media()
        except Exception as error:
            raise _translate(error, f"eject of {media.identity}") from error
        return f"{media.identity} ejected"

    def _config_media(self, system):
        from sushy import VirtualMediaType

        boot, _ = self._boot_media(system)
        for media in self._media_members(system):
            types = media.media_types or []
            if media.identity != boot.identity and (
                VirtualMediaType.FLOPPY in types or VirtualMediaType.USB_STICK in types
            ):
                return media
        raise BmcError(
            "unsupported", "the BMC's virtual media has no second device (floppy or USB stick) for a config drive"
        )

    def _media_members(self, system) -> list:
        from sushy.exceptions import MissingAttributeError

        try:
            return system.virtual_media.get_members()
        except MissingAttributeError as error:  # no VirtualMedia link on the system
            raise BmcError("unsupported", "the BMC offers no virtual media for the system") from error
        except Exception as error:
            translated = _translate(error, "virtual media")
            if translated.retryable:
                raise translated from error
            raise BmcError("unsupported", f"the BMC offers no virtual media for the system ({translated})") from error

    def _boot_media(self, system):
        """The system's virtual CD (else USB stick) and the boot target that boots it."""
        from sushy import BootSource, VirtualMediaType

        members = self._media_members(system)
        for wanted, target in ((VirtualMediaType.CD, BootSource.CD), (VirtualMediaType.USB_STICK, BootSource.USB_CD)):
            for media in members:
                if wanted in (media.media_types or []):
                    return media, target
        raise BmcError("unsupported", "the BMC's virtual media has no CD or USB stick to boot from")


def _connect(url: str, username: str, password: str, bmc: RedfishBmc) -> sushy.Sushy:
    import sushy
    from sushy import auth

    return sushy.Sushy(
        url,
        auth=auth.BasicAuth(username, password),
        verify=bmc.verify,
        # One attempt per request (sushy takes 0 to mean its default of 3): the caller bounds retries.
        server_side_retries=1,
        server_side_retries_delay=1,
        read_timeout=bmc.timeout_s,
        connect_timeout=bmc.timeout_s,
    )


def _power_state(system) -> str:
    return system.power_state.value if system.power_state is not None else "Unknown"


def _info(system) -> SystemInfo:
    raw = system.json
    memory = (raw.get("MemorySummary") or {}).get("TotalSystemMemoryGiB")
    cpus = (raw.get("ProcessorSummary") or {}).get("Count")
    return SystemInfo(
        system_id=system.identity,
        name=system.name,
        power_state=system.power_state.value if system.power_state is not None else None,  # None: not reported
        manufacturer=system.manufacturer,
        model=system.model,
        serial_number=system.serial_number,
        cpu_count=int(cpus) if isinstance(cpus, int) else None,
        memory_gib=float(memory) if isinstance(memory, int | float) else None,
        bios_version=raw.get("BiosVersion"),
        uuid=system.uuid,
    )


def discover(
    url: str, username: str, password: str, *, timeout_s: float = 10.0, verify: bool | str = True
) -> list[SystemInfo]:
    """Every system a BMC (or a chassis manager) lists in its Systems collection."""
    bmc = RedfishBmc(BmcEndpoint(url, "", username, password), timeout_s=timeout_s, verify=verify)
    try:
        systems = bmc._sushy().get_system_collection().get_members()
        return [_info(system) for system in systems]
    except Exception as error:
        raise _translate(error, f"Systems of {url}") from error


@dataclass(frozen=True)
class Bmcs:
    """Makes the one Redfish client of a node's BMC; `bootstrap.bmcs` builds it from the settings."""

    credentials: BmcCredentials
    timeout_s: float
    power_wait_s: float
    poll_s: float
    verify: bool | str
    allow_insecure: bool = False

    def for_node(self, url: str, system_id: str, credential_ref: str) -> RedfishBmc:
        require_tls(url, allow_insecure=self.allow_insecure)
        username, password = self.credentials.resolve(credential_ref)
        return RedfishBmc(
            BmcEndpoint(url, system_id, username, password),
            timeout_s=self.timeout_s,
            power_wait_s=self.power_wait_s,
            poll_s=self.poll_s,
            verify=self.verify,
        )

    def discover(self, url: str, credential_ref: str) -> list[SystemInfo]:
        require_tls(url, allow_insecure=self.allow_insecure)
        username, password = self.credentials.resolve(credential_ref)
        return discover(url, username, password, timeout_s=self.timeout_s, verify=self.verify)
