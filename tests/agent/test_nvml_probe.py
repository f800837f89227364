"""The NVML probe against a fake `pynvml` installed in `sys.modules`.

The fake keeps the real module's constants, error classes (the generated `NVMLError_*`
subclasses) and ctypes handle types, and replaces only the functions that would call into
libnvidia-ml. Device handles are real `c_nvmlDevice_t` pointers and event data is a real
`c_nvmlEventData_t` carrying a fresh pointer, as NVML returns them.
"""

from __future__ import annotations

import ctypes
import sys
import types
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pynvml as real
import pytest

from gpucloud.adapters.nvml import FatalProbeError, NvmlProbe, ProbeError
from gpucloud.adapters.probe import detect_probe
from gpucloud.protocol import reports
from gpucloud.protocol.reports import FatalKind
from gpucloud.sim.probe import SimulatedProbe

pytestmark = pytest.mark.unit

NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def clock() -> datetime:
    return NOW


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    temperature_c: int = 41
    power_mw: int = 312_500
    # (error type, counter type) -> count; distinct values catch a swapped argument.
    ecc: dict[tuple[int, int], int] = field(
        default_factory=lambda: {
            (real.NVML_MEMORY_ERROR_TYPE_CORRECTED, real.NVML_VOLATILE_ECC): 11,
            (real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, real.NVML_VOLATILE_ECC): 2,
            (real.NVML_MEMORY_ERROR_TYPE_CORRECTED, real.NVML_AGGREGATE_ECC): 1100,
            (real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, real.NVML_AGGREGATE_ECC): 3,
        }
    )
    remapped_rows: tuple[int, int, int, int] = (4, 1, 1, 0)
    # link -> active; links not listed do not exist (NVML: InvalidArgument).
    links: dict[int, bool] = field(default_factory=lambda: {0: True, 1: True, 2: False, 3: True})
    # counter type -> count per link (link number added, so each link reads differently).
    link_counters: dict[int, int] = field(
        default_factory=lambda: {
            real.NVML_NVLINK_ERROR_DL_REPLAY: 100,
            real.NVML_NVLINK_ERROR_DL_RECOVERY: 200,
            real.NVML_NVLINK_ERROR_DL_CRC_FLIT: 300,
            real.NVML_NVLINK_ERROR_DL_CRC_DATA: 400,
        }
    )
    pcie_replay: int = 7
    clock_reasons: int = real.nvmlClocksEventReasonGpuIdle | real.nvmlClocksEventReasonHwThermalSlowdown
    supported_events: int = real.nvmlEventTypeXidCriticalError | real.nvmlEventTypeDoubleBitEccError
    lost: bool = False
    # function name -> NVML error code raised for this GPU
    errors: dict[str, int] = field(default_factory=dict)


class FakeNvml:
    """The state behind the fake module: GPUs, init errors, queued events, calls seen."""

    def __init__(self, gpus: list[FakeGpu]):
        self.gpus = gpus
        self.structs = [real.struct_c_nvmlDevice_t() for _ in gpus]
        self.init_error: int | None = None
        self.initialized = False
        self.shutdown_calls = 0
        self.events: list[tuple[int, int, int]] = []  # (gpu index, event type, data)
        self.wait_timeouts: list[int] = []
        self.wait_error: int | None = None
        self.event_set_error: int | None = None
        self.registered: dict[int, int] = {}
        self.freed = False

    def gpu(self, handle) -> tuple[int, FakeGpu]:
        address = ctypes.cast(handle, ctypes.c_void_p).value
        index = next(i for i, s in enumerate(self.structs) if ctypes.addressof(s) == address)
        return index, self.gpus[index]

    def module(self) -> types.ModuleType:
        module = types.ModuleType("pynvml")
        for name in dir(real):
            if name.startswith(("NVML", "nvmlEventType", "nvmlClocks", "c_nvml", "struct_c_nvml")):
                setattr(module, name, getattr(real, name))
        fake = self

        def device_call(fn):
            def wrapper(handle, *args):
                _index, gpu = fake.gpu(handle)
                if gpu.lost:
                    raise real.NVMLError(real.NVML_ERROR_GPU_IS_LOST)
                if fn.__name__ in gpu.errors:
                    raise real.NVMLError(gpu.errors[fn.__name__])
                return fn(gpu, *args)

            wrapper.__name__ = fn.__name__
            setattr(module, fn.__name__, wrapper)
            return wrapper

        def module_call(fn):
            setattr(module, fn.__name__, fn)
            return fn

        @module_call
        def nvmlInit():
            if fake.init_error is not None:
                raise real.NVMLError(fake.init_error)
            fake.initialized = True

        @module_call
        def nvmlShutdown():
            fake.shutdown_calls += 1
            fake.initialized = False

        @module_call
        def nvmlDeviceGetCount():
            return len(fake.gpus)

        @module_call
        def nvmlDeviceGetHandleByIndex(index):
            if fake.gpus[index].lost:
                raise real.NVMLError(real.NVML_ERROR_GPU_IS_LOST)
            return ctypes.pointer(fake.structs[index])

        @device_call
        def nvmlDeviceGetUUID(gpu):
            return gpu.uuid

        @device_call
        def nvmlDeviceGetName(gpu):
            return gpu.name

        @device_call
        def nvmlDeviceGetTemperatureV(gpu, sensor, version=real.nvmlTemperature_v1):
            assert sensor == real.NVML_TEMPERATURE_GPU
            return gpu.temperature_c

        @device_call
        def nvmlDeviceGetTemperature(gpu, sensor):
            assert sensor == real.NVML_TEMPERATURE_GPU
            return gpu.temperature_c

        @device_call
        def nvmlDeviceGetPowerUsage(gpu):
            return gpu.power_mw

        @device_call
        def nvmlDeviceGetTotalEccErrors(gpu, error_type, counter_type):
            return gpu.ecc[(error_type, counter_type)]

        @device_call
        def nvmlDeviceGetRemappedRows(gpu):
            return gpu.remapped_rows

        @device_call
        def nvmlDeviceGetNvLinkState(gpu, link):
            if link not in gpu.links:
                raise real.NVMLError(real.NVML_ERROR_INVALID_ARGUMENT)
            return int(gpu.links[link])

        @device_call
        def nvmlDeviceGetNvLinkErrorCounter(gpu, link, counter):
            return gpu.link_counters[counter] + link

        @device_call
        def nvmlDeviceGetPcieReplayCounter(gpu):
            return gpu.pcie_replay

        @device_call
        def nvmlDeviceGetCurrentClocksEventReasons(gpu):
            return gpu.clock_reasons

        @device_call
        def nvmlDeviceGetCurrentClocksThrottleReasons(gpu):
            return gpu.clock_reasons

        @device_call
        def nvmlDeviceGetSupportedEventTypes(gpu):
            return gpu.supported_events

        @module_call
        def nvmlEventSetCreate():
            if fake.event_set_error is not None:
                raise real.NVMLError(fake.event_set_error)
            return real.c_nvmlEventSet_t()

        @module_call
        def nvmlDeviceRegisterEvents(handle, event_types, event_set):
            index, gpu = fake.gpu(handle)
            if "nvmlDeviceRegisterEvents" in gpu.errors:
                raise real.NVMLError(gpu.errors["nvmlDeviceRegisterEvents"])
            fake.registered[index] = event_types

        @module_call
        def nvmlEventSetWait_v2(event_set, timeout_ms):
            fake.wait_timeouts.append(timeout_ms)
            if fake.wait_error is not None:
                raise real.NVMLError(fake.wait_error)
            if not fake.events:
                raise real.NVMLError(real.NVML_ERROR_TIMEOUT)
            index, event_type, value = fake.events.pop(0)
            data = real.c_nvmlEventData_t()
            data.device = ctypes.cast(ctypes.addressof(fake.structs[index]), real.c_nvmlDevice_t)
            data.eventType = event_type
            data.eventData = value
            return data

        @module_call
        def nvmlEventSetFree(event_set):
            fake.freed = True

        return module


@pytest.fixture
def fake(monkeypatch) -> FakeNvml:
    nvml = FakeNvml([FakeGpu(uuid="GPU-aaaa"), FakeGpu(uuid="GPU-bbbb", links={})])
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module())
    return nvml


def test_readings_are_decoded(fake):
    reading = NvmlProbe("node-1", clock=clock).read()

    assert reading.is_gpu_node and reading.fatal_error is None
    assert reading.node_id == "node-1" and reading.timestamp == NOW
    gpu = reading.gpus[0]
    assert (gpu.index, gpu.uuid, gpu.name) == (0, "GPU-aaaa", "NVIDIA H100 80GB HBM3")
    assert gpu.temperature_c == 41 and gpu.power_w == 312.5
    assert gpu.ecc.model_dump() == {
        "volatile_corrected": 11,
        "volatile_uncorrected": 2,
        "aggregate_corrected": 1100,
        "aggregate_uncorrected": 3,
    }
    assert gpu.remapped_rows.model_dump() == {"correctable": 4, "uncorrectable": 1, "pending": True, "failure": False}
    assert [(link.link, link.active) for link in gpu.nvlinks] == [(0, True), (1, True), (2, False), (3, True)]
    link3 = gpu.nvlinks[3]
    assert (link3.replay, link3.recovery, link3.crc_flit, link3.crc_data) == (103, 203, 303, 403)
    assert gpu.nvlinks[2].crc_flit is None
    assert gpu.pcie_replay == 7
    assert gpu.clock_event_reason_names == ["gpu_idle", "hw_thermal_slowdown"]
    assert reading.gpus[1].uuid == "GPU-bbbb" and reading.gpus[1].nvlinks == ()


def test_pynvml_not_installed_means_not_a_gpu_node(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    probe = NvmlProbe("cpu-node", clock=clock)

    reading = probe.read()

    assert reading.is_gpu_node is False and reading.fatal_error is None and reading.gpus == ()
    assert probe.wait_events(0) == []


def test_library_not_found_means_not_a_gpu_node(fake):
    fake.init_error = real.NVML_ERROR_LIBRARY_NOT_FOUND

    reading = NvmlProbe("cpu-node", clock=clock).read()

    assert reading.is_gpu_node is False and reading.fatal_error is None


def test_driver_not_loaded_is_fatal_and_retried(fake):
    fake.init_error = real.NVML_ERROR_DRIVER_NOT_LOADED
    probe = NvmlProbe("node-1", clock=clock)

    reading = probe.read()

    assert reading.is_gpu_node is True
    assert reading.fatal_error.kind is FatalKind.DRIVER_NOT_LOADED
    with pytest.raises(FatalProbeError) as raised:
        probe.wait_events(0)
    assert raised.value.fatal.kind is FatalKind.DRIVER_NOT_LOADED

    fake.init_error = None
    assert probe.read().fatal_error is None


def test_gpu_lost_is_fatal_and_the_other_gpus_are_still_read(fake):
    probe = NvmlProbe("node-1", clock=clock)
    probe.read()
    fake.gpus[0].lost = True

    reading = probe.read()

    assert reading.fatal_error.kind is FatalKind.GPU_LOST and reading.fatal_error.gpu_index == 0
    assert [g.uuid for g in reading.gpus] == ["GPU-bbbb"]


def test_gpu_lost_before_open_is_fatal(fake):
    fake.gpus[1].lost = True

    reading = NvmlProbe("node-1", clock=clock).read()

    assert reading.fatal_error.kind is FatalKind.GPU_LOST and reading.fatal_error.gpu_index == 1
    assert [g.index for g in reading.gpus] == [0]


def test_gpu_lost_while_waiting_for_events_raises_fatal(fake):
    probe = NvmlProbe("node-1", clock=clock)
    probe.read()
    fake.wait_error = real.NVML_ERROR_GPU_IS_LOST

    with pytest.raises(FatalProbeError) as raised:
        probe.wait_events(1.0)
    assert raised.value.fatal.kind is FatalKind.GPU_LOST


def test_event_wait_timeout_means_no_events(fake):
    probe = NvmlProbe("node-1", clock=clock)

    assert probe.wait_events(2.5) == []
    assert fake.wait_timeouts == [2500]


def test_xid_events_are_decoded_and_a_burst_is_drained_in_one_call(fake):
    probe = NvmlProbe("node-1", clock=clock)
    fake.events = [
        (1, real.nvmlEventTypeXidCriticalError, 79),
        (0, real.nvmlEventTypeDoubleBitEccError, 0),
        (0, real.nvmlEventTypeXidCriticalError, 13),
    ]

    events = probe.wait_events(5)

    assert [(e.gpu_index, e.gpu_uuid, e.xid) for e in events] == [(1, "GPU-bbbb", 79), (0, "GPU-aaaa", 13)]
    assert events[0].node_id == "node-1" and events[0].timestamp == NOW
    assert "fallen off the bus" in events[0].message
    assert fake.wait_timeouts == [5000, 0, 0, 0]


def test_only_xid_events_are_registered_and_unsupported_gpus_are_skipped(fake):
    fake.gpus[1].supported_events = real.nvmlEventTypeDoubleBitEccError

    NvmlProbe("node-1", clock=clock).read()

    assert fake.registered == {0: real.nvmlEventTypeXidCriticalError}


def test_a_gpu_without_event_support_is_still_read(fake):
    fake.event_set_error = real.NVML_ERROR_NOT_SUPPORTED
    probe = NvmlProbe("node-1", clock=clock)

    assert probe.read().fatal_error is None
    assert probe.wait_events(0) == [] and fake.wait_timeouts == []


def test_unsupported_counters_are_none(fake):
    gpu = fake.gpus[0]
    gpu.errors = dict.fromkeys(
        (
            "nvmlDeviceGetTotalEccErrors",
            "nvmlDeviceGetRemappedRows",
            "nvmlDeviceGetNvLinkState",
            "nvmlDeviceGetPcieReplayCounter",
            "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetTemperatureV",
            "nvmlDeviceGetTemperature",
            "nvmlDeviceRegisterEvents",
        ),
        real.NVML_ERROR_NOT_SUPPORTED,
    )
    gpu.errors["nvmlDeviceGetCurrentClocksEventReasons"] = real.NVML_ERROR_FUNCTION_NOT_FOUND

    reading = NvmlProbe("node-1", clock=clock).read()

    g = reading.gpus[0]
    assert reading.fatal_error is None
    assert g.ecc.model_dump() == dict.fromkeys(
        ("volatile_corrected", "volatile_uncorrected", "aggregate_corrected", "aggregate_uncorrected")
    )
    assert g.remapped_rows is None and g.nvlinks == () and g.pcie_replay is None
    assert g.power_w is None and g.temperature_c is None
    # An older driver without the renamed call still answers under the old name.
    assert g.clock_event_reason_names == ["gpu_idle", "hw_thermal_slowdown"]


def test_an_unexpected_nvml_error_is_a_probe_error_not_a_fatal_one(fake):
    fake.gpus[0].errors = {"nvmlDeviceGetPcieReplayCounter": real.NVML_ERROR_UNKNOWN}

    with pytest.raises(ProbeError) as raised:
        NvmlProbe("node-1", clock=clock).read()
    assert not isinstance(raised.value, FatalProbeError)


def test_close_frees_the_event_set_and_shuts_down(fake):
    probe = NvmlProbe("node-1", clock=clock)
    probe.read()

    probe.close()
    probe.close()

    assert fake.freed and fake.shutdown_calls == 1


def test_clock_reason_table_matches_pynvml():
    for name in dir(real):
        if name.startswith("nvmlClocksThrottleReason") and name not in (
            "nvmlClocksThrottleReasonAll",
            "nvmlClocksThrottleReasonNone",
            "nvmlClocksThrottleReasonUserDefinedClocks",
        ):
            bit = getattr(real, name)
            assert bit in reports.CLOCK_EVENT_REASONS, name
    assert reports.decode_clock_event_reasons(real.nvmlClocksEventReasonSwPowerCap | 1 << 20) == [
        "sw_power_cap",
        "bit_20",
    ]


def test_detect_probe_picks_nvml_where_present_and_simulation_elsewhere(fake, monkeypatch):
    assert isinstance(detect_probe("gpu-node", clock=clock), NvmlProbe)

    fake.init_error = real.NVML_ERROR_LIBRARY_NOT_FOUND
    laptop = detect_probe("laptop", clock=clock, simulated=lambda: SimulatedProbe("laptop", clock=clock))
    assert isinstance(laptop, SimulatedProbe)
    production = detect_probe("cpu-node", clock=clock)
    assert isinstance(production, NvmlProbe) and production.read().is_gpu_node is False

    fake.init_error = real.NVML_ERROR_DRIVER_NOT_LOADED
    broken = detect_probe("broken-gpu-node", clock=clock, simulated=lambda: SimulatedProbe("broken", clock=clock))
    assert isinstance(broken, NvmlProbe)
