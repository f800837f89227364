"""The real GPU probe: reads a node's GPUs through NVML (`pynvml`, from nvidia-ml-py).

Its job is to turn NVML's calls and error codes into `protocol.reports` models, and to keep three
situations apart that NVML reports all as exceptions:

- No NVML library (pynvml missing, or `NVMLError_LibraryNotFound`): this is not a GPU node. The
  probe says so (`is_gpu_node=False`); it is not an error.
- The library is there but the driver or a GPU is gone (`DriverNotLoaded`, `GpuIsLost`,
  `ResetRequired`, `LibRmVersionMismatch`): fatal. `read()` reports it in
  `NodeReading.fatal_error`; `wait_events()` raises `FatalProbeError`.
- A counter this GPU or driver lacks (`NotSupported`, `FunctionNotFound`): the field is `None`.

Any other NVML error raises `ProbeError`: transient as far as the probe can tell, so the agent
logs it and reads again at the next tick.

pynvml is imported lazily, at the first read, so this module imports on machines without it.
"""

from __future__ import annotations

import ctypes
import importlib
import threading
import time
from collections.abc import Callable
from datetime import datetime
from types import ModuleType
from typing import Any

from gpucloud.health.xid import classify_xid
from gpucloud.protocol.reports import (
    EccCounts,
    FatalKind,
    GpuReading,
    NodeReading,
    NvLinkReading,
    ProbeFatal,
    RemappedRows,
    XidEvent,
    utc_now,
)

_FATAL_ERRORS = {
    "NVMLError_DriverNotLoaded": FatalKind.DRIVER_NOT_LOADED,
    "NVMLError_GpuIsLost": FatalKind.GPU_LOST,
    "NVMLError_ResetRequired": FatalKind.RESET_REQUIRED,
    "NVMLError_LibRmVersionMismatch": FatalKind.DRIVER_MISMATCH,
}
_UNSUPPORTED_ERRORS = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound")
# More events than this in one wait means an XID storm; the rest stay queued for the next call
# rather than holding the caller in a loop.
MAX_EVENTS_PER_WAIT = 256


class ProbeError(Exception):
    """An NVML call failed in a way that says nothing certain about the node's health."""


class FatalProbeError(ProbeError):
    """The driver or a GPU is gone: the node cannot run GPU work until it is repaired."""

    def __init__(self, fatal: ProbeFatal):
        super().__init__(f"{fatal.kind}: {fatal.detail}")
        self.fatal = fatal


class _LibraryMissing(Exception):
    """No NVML library on this machine: not a GPU node (internal signal, never escapes)."""


def load_pynvml() -> ModuleType | None:
    """The pynvml module, or None where nvidia-ml-py is not installed."""
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


def _is_error(nvml: ModuleType, err: Exception, class_name: str) -> bool:
    error_class = getattr(nvml, class_name, None)
    return error_class is not None and isinstance(err, error_class)


def _fatal_kind(nvml: ModuleType, err: Exception) -> FatalKind | None:
    for class_name, kind in _FATAL_ERRORS.items():
        if _is_error(nvml, err, class_name):
            return kind
    return None


def _text(value: str | bytes) -> str:
    # pynvml decodes strings on Python 3; older releases returned bytes.
    return value.decode() if isinstance(value, bytes) else value


def _handle_key(handle: Any) -> Any:
    """A stable key for a device handle: event data carries a fresh ctypes pointer object."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return handle


class NvmlSession:
    """One initialised NVML: device handles, the XID event set, and the reads.

    `open()` returns None on a machine without NVML; every method may raise `FatalProbeError`
    or `ProbeError` as described in the module docstring.
    """

    def __init__(self, nvml: ModuleType, *, node_id: str, clock: Callable[[], datetime]):
        self._nvml = nvml
        self._node_id = node_id
        self._clock = clock
        self._handles: list[Any | None] = []
        self._lost: dict[int, ProbeFatal] = {}
        self._uuids: list[str] = []
        self._index_by_handle: dict[Any, int] = {}
        self._links: dict[int, list[int]] = {}
        self._event_set: Any = None
        self._initialized = False

    @classmethod
    def open(cls, *, node_id: str, clock: Callable[[], datetime] = utc_now) -> NvmlSession | None:
        nvml = load_pynvml()
        if nvml is None:
            return None
        session = cls(nvml, node_id=node_id, clock=clock)
        try:
            session._call(nvml.nvmlInit)
        except _LibraryMissing:
            return None
        session._initialized = True
        try:
            session._discover_devices()
            session._register_xid_events()
        except ProbeError:
            session.close()
            raise
        return session

    def _call(self, fn: Callable[..., Any], *args: Any, gpu_index: int | None = None, optional: bool = False) -> Any:
        """Call NVML, translating its errors; `optional` reads return None when unsupported."""
        try:
            return fn(*args)
        except self._nvml.NVMLError as err:
            if optional and any(_is_error(self._nvml, err, name) for name in _UNSUPPORTED_ERRORS):
                return None
            raise self._translate(err, getattr(fn, "__name__", repr(fn)), gpu_index) from err

    def _translate(self, err: Exception, call: str, gpu_index: int | None) -> Exception:
        if _is_error(self._nvml, err, "NVMLError_LibraryNotFound"):
            return _LibraryMissing(str(err))
        kind = _fatal_kind(self._nvml, err)
        if kind is not None:
            return FatalProbeError(ProbeFatal(kind=kind, gpu_index=gpu_index, detail=f"{call}: {err}"))
        return ProbeError(f"{call} failed on GPU {gpu_index}: {err}")

    def _discover_devices(self) -> None:
        """Handles and UUIDs of every GPU; a GPU already lost is remembered, not fatal to the rest.

        The session keeps these handles for its life: after a GPU reset, close the probe and the
        next read opens a session that sees the GPU again.
        """
        nvml = self._nvml
        for index in range(self._call(nvml.nvmlDeviceGetCount)):
            try:
                handle = self._call(nvml.nvmlDeviceGetHandleByIndex, index, gpu_index=index)
                uuid = _text(self._call(nvml.nvmlDeviceGetUUID, handle, gpu_index=index))
            except FatalProbeError as err:
                if err.fatal.kind is not FatalKind.GPU_LOST:
                    raise
                self._lost[index] = err.fatal
                handle, uuid = None, ""
            self._handles.append(handle)
            self._uuids.append(uuid)
            if handle is not None:
                self._index_by_handle[_handle_key(handle)] = index

    def _register_xid_events(self) -> None:
        nvml = self._nvml
        # Without event support (some virtualised GPUs) XIDs go unseen; the counter trends in
        # `read()` still cover the GPUs.
        self._event_set = self._call(nvml.nvmlEventSetCreate, optional=True)
        if self._event_set is None:
            return
        for index, handle in enumerate(self._handles):
            if handle is None:
                continue
            supported = self._call(nvml.nvmlDeviceGetSupportedEventTypes, handle, gpu_index=index, optional=True)
            mask = nvml.nvmlEventTypeXidCriticalError & (supported or 0)
            if mask:
                self._call(nvml.nvmlDeviceRegisterEvents, handle, mask, self._event_set, gpu_index=index, optional=True)

    @property
    def uuids(self) -> list[str]:
        return list(self._uuids)

    def read_gpus(self) -> tuple[list[GpuReading], ProbeFatal | None]:
        """Every GPU that can be read, and the first fatal failure met on the way, if any.

        One lost GPU does not hide the other seven: their counters are what tells a lost GPU
        apart from a lost node.
        """
        gpus: list[GpuReading] = []
        fatal = next(iter(self._lost.values()), None)
        for index, handle in enumerate(self._handles):
            if handle is None:
                continue
            try:
                gpus.append(self._read_gpu(index, handle))
            except FatalProbeError as err:
                fatal = fatal or err.fatal
        return gpus, fatal

    def _read_gpu(self, index: int, handle: Any) -> GpuReading:
        nvml = self._nvml

        def read(fn: Callable[..., Any], *args: Any) -> Any:
            return self._call(fn, handle, *args, gpu_index=index, optional=True)

        power_mw = read(nvml.nvmlDeviceGetPowerUsage)
        return GpuReading(
            index=index,
            uuid=self._uuids[index],
            name=_text(self._call(nvml.nvmlDeviceGetName, handle, gpu_index=index)),
            temperature_c=self._first_supported(
                index, handle, ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"), nvml.NVML_TEMPERATURE_GPU
            ),
            power_w=None if power_mw is None else power_mw / 1000.0,
            ecc=self._read_ecc(read),
            remapped_rows=self._read_remapped_rows(read),
            nvlinks=tuple(self._read_nvlinks(index, handle)),
            pcie_replay=read(nvml.nvmlDeviceGetPcieReplayCounter),
            clock_event_reasons=self._first_supported(
                index, handle, ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
            ),
        )

    def _first_supported(self, index: int, handle: Any, names: tuple[str, ...], *args: Any) -> Any:
        """The first of NVML's renamed functions (newest first) that this pynvml and driver have."""
        for name in names:
            fn = getattr(self._nvml, name, None)
            if fn is None:
                continue
            value = self._call(fn, handle, *args, gpu_index=index, optional=True)
            if value is not None:
                return value
        return None

    def _read_ecc(self, read: Callable[..., Any]) -> EccCounts:
        nvml = self._nvml
        get = nvml.nvmlDeviceGetTotalEccErrors
        corrected, uncorrected = nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        return EccCounts(
            volatile_corrected=read(get, corrected, nvml.NVML_VOLATILE_ECC),
            volatile_uncorrected=read(get, uncorrected, nvml.NVML_VOLATILE_ECC),
            aggregate_corrected=read(get, corrected, nvml.NVML_AGGREGATE_ECC),
            aggregate_uncorrected=read(get, uncorrected, nvml.NVML_AGGREGATE_ECC),
        )

    def _read_remapped_rows(self, read: Callable[..., Any]) -> RemappedRows | None:
        rows = read(self._nvml.nvmlDeviceGetRemappedRows)
        if rows is None:
            return None
        correctable, uncorrectable, pending, failure = rows
        return RemappedRows(
            correctable=correctable, uncorrectable=uncorrectable, pending=bool(pending), failure=bool(failure)
        )

    def _read_nvlinks(self, index: int, handle: Any) -> list[NvLinkReading]:
        nvml = self._nvml
        if index not in self._links:
            self._links[index] = self._discover_links(index, handle)
        readings = []
        for link in self._links[index]:
            active = self._call(nvml.nvmlDeviceGetNvLinkState, handle, link, gpu_index=index, optional=True)
            if not active:
                readings.append(NvLinkReading(link=link, active=False))
                continue

            def counter(kind: int, link: int = link) -> int | None:
                return self._call(
                    nvml.nvmlDeviceGetNvLinkErrorCounter, handle, link, kind, gpu_index=index, optional=True
                )

            readings.append(
                NvLinkReading(
                    link=link,
                    active=True,
                    replay=counter(nvml.NVML_NVLINK_ERROR_DL_REPLAY),
                    recovery=counter(nvml.NVML_NVLINK_ERROR_DL_RECOVERY),
                    crc_flit=counter(nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT),
                    crc_data=counter(nvml.NVML_NVLINK_ERROR_DL_CRC_DATA),
                )
            )
        return readings

    def _discover_links(self, index: int, handle: Any) -> list[int]:
        """The link numbers this GPU has: probed once, since a board's links do not change.

        NVML answers NotSupported for a GPU without NVLink and InvalidArgument for a link number
        past this GPU's last link; both mean "no such link".
        """
        nvml = self._nvml
        links = []
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                nvml.nvmlDeviceGetNvLinkState(handle, link)
            except nvml.NVMLError as err:
                if _is_error(nvml, err, "NVMLError_NotSupported") or _is_error(nvml, err, "NVMLError_InvalidArgument"):
                    continue
                raise self._translate(err, "nvmlDeviceGetNvLinkState", index) from err
            links.append(link)
        return links

    def wait_events(self, timeout_ms: int) -> list[XidEvent]:
        """Block up to `timeout_ms` for XID events; return at once with all already queued.

        NVML_ERROR_TIMEOUT means "no event", not a failure.
        """
        nvml = self._nvml
        if self._event_set is None:
            time.sleep(max(0, timeout_ms) / 1000)
            return []
        events: list[XidEvent] = []
        wait_ms = max(0, int(timeout_ms))
        while len(events) < MAX_EVENTS_PER_WAIT:
            try:
                data = nvml.nvmlEventSetWait_v2(self._event_set, wait_ms)
            except nvml.NVMLError as err:
                if _is_error(nvml, err, "NVMLError_Timeout"):
                    break
                raise self._translate(err, "nvmlEventSetWait_v2", None) from err
            if data.eventType & nvml.nvmlEventTypeXidCriticalError:
                events.append(self._xid_event(data))
            # Later events of a burst are already queued: drain them without waiting again.
            wait_ms = 0
        return events

    def _xid_event(self, data: Any) -> XidEvent:
        index = self._index_by_handle.get(_handle_key(data.device))
        xid = int(data.eventData)
        return XidEvent(
            node_id=self._node_id,
            gpu_index=index,
            gpu_uuid=None if index is None else self._uuids[index],
            xid=xid,
            timestamp=self._clock(),
            message=f"XID {xid}: {classify_xid(xid).meaning}",
        )

    def close(self) -> None:
        """Free the event set and shut NVML down; safe to call twice or after a failed open.

        NVML counts inits per process, so a second shutdown would undo someone else's init.
        """
        if not self._initialized:
            return
        nvml, self._initialized, self._handles = self._nvml, False, []
        event_set, self._event_set = self._event_set, None
        try:
            if event_set is not None:
                nvml.nvmlEventSetFree(event_set)
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            # Shutting down a session whose driver is already gone fails the same way; there is
            # nothing left to release.
            pass


class NvmlProbe:
    """The `Probe` for a real node: opens NVML on first use and re-opens after a fatal init.

    A driver that is not loaded yet (the host is still booting, or is being repaired) is reported
    as fatal on every read until it loads; the next read then opens NVML again.
    """

    def __init__(self, node_id: str, *, clock: Callable[[], datetime] = utc_now):
        self._node_id = node_id
        self._clock = clock
        self._session: NvmlSession | None = None
        self._is_gpu_node: bool | None = None
        # The agent reads from one thread while another blocks in wait_events(); NVML itself is
        # thread-safe, but opening the session must happen once.
        self._open_lock = threading.Lock()

    def _open(self) -> NvmlSession | None:
        with self._open_lock:
            if self._session is None and self._is_gpu_node is not False:
                self._session = NvmlSession.open(node_id=self._node_id, clock=self._clock)
                self._is_gpu_node = self._session is not None
            return self._session

    @property
    def uuids(self) -> list[str]:
        session = self._open()
        return session.uuids if session else []

    def read(self) -> NodeReading:
        now = self._clock()
        try:
            session = self._open()
        except FatalProbeError as err:
            return NodeReading(node_id=self._node_id, timestamp=now, is_gpu_node=True, fatal_error=err.fatal)
        if session is None:
            return NodeReading(node_id=self._node_id, timestamp=now, is_gpu_node=False)
        gpus, fatal = session.read_gpus()
        return NodeReading(node_id=self._node_id, timestamp=now, is_gpu_node=True, gpus=tuple(gpus), fatal_error=fatal)

    def wait_events(self, timeout_s: float) -> list[XidEvent]:
        """XID events within `timeout_s`; on a CPU node none ever come, so it just waits."""
        session = self._open()
        if session is None:
            time.sleep(max(0.0, timeout_s))
            return []
        return session.wait_events(int(timeout_s * 1000))

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
