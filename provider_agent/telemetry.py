"""The agent's telemetry (issue #25): what its GPUs, CPU and memory are doing and how long
each job spent loading, running and uploading. Sent to the broker in heartbeats (at most
once per ``interval_s``), and served on an optional agent-local ``/metrics``.

GPUs are read through NVML (``nvidia-ml-py``, imported as ``pynvml``) behind
:class:`GpuSource`; :class:`NvmlGpuSource` takes the NVML module at construction, so tests
run the same code over a fake module (tests/unit/provider_agent/test_telemetry.py) where no
GPU exists, and over the real library where one does (the ``gpu`` marker). Without a GPU
(no library, no driver, no device) the agent reports its CPU and memory and says why there
is no GPU figure (``gpu_note``). CPU and memory come from ``psutil``.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger("agent.telemetry")

MAX_JOB_TIMINGS = 64  # job timings held for the next report (older ones are dropped)


@dataclass
class GpuReading:
    index: int
    name: str
    utilization: float          # 0..1
    memory_used_bytes: int
    memory_total_bytes: int
    temperature_c: float
    power_w: float
    power_limit_w: float = 0.0


class GpuSource(Protocol):
    """Where GPU figures come from. ``available`` is False (and ``note`` says why) when
    there is nothing to read; :meth:`read` then returns []."""

    available: bool
    note: str

    def read(self) -> list[GpuReading]: ...


class NoGpuSource:
    """No GPU to read (``note``: why)."""

    def __init__(self, note: str):
        self.available = False
        self.note = note

    def read(self) -> list[GpuReading]:
        return []


class NvmlGpuSource:
    """Every NVIDIA GPU NVML sees. ``nvml``: the NVML module (``pynvml`` by default; a
    fake in tests). A figure a device does not support (power on some boards) reads 0."""

    def __init__(self, nvml=None):
        self.available = False
        self.note = ""
        self._handles: list = []
        self._lock = threading.Lock()
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                self.note = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
                return
        self.nvml = nvml
        try:
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded…
            self.note = f"no NVIDIA GPU readable through NVML: {_nvml_error(exc)}"
            return
        if not self._handles:
            self.note = "NVML found no NVIDIA GPU on this machine"
            return
        self.available = True
        self._names = [_text(nvml.nvmlDeviceGetName(h)) for h in self._handles]

    def read(self) -> list[GpuReading]:
        if not self.available:
            return []
        nvml = self.nvml
        out = []
        with self._lock:  # NVML calls from the heartbeat and the /metrics threads
            for i, h in enumerate(self._handles):
                util = _try(lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0)
                mem = _try(lambda: nvml.nvmlDeviceGetMemoryInfo(h), None)
                temp = _try(lambda: float(nvml.nvmlDeviceGetTemperature(
                    h, nvml.NVML_TEMPERATURE_GPU)))
                power = _try(lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0)  # mW
                limit = _try(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0)
                out.append(GpuReading(
                    index=i, name=self._names[i], utilization=float(util),
                    memory_used_bytes=int(mem.used) if mem is not None else 0,
                    memory_total_bytes=int(mem.total) if mem is not None else 0,
                    temperature_c=temp, power_w=float(power), power_limit_w=float(limit)))
        return out

    def close(self) -> None:
        if self.available:
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self.available = False


def _try(fn, default=0.0):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - NVMLError_NotSupported on this board
        return default


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_error(exc: Exception) -> str:
    name = type(exc).__name__
    text = str(exc) or name
    if "LibraryNotFound" in name or "Library Not Found" in text:
        return "the NVML library (libnvidia-ml.so, from the NVIDIA driver) is not installed"
    if "DriverNotLoaded" in name or "Driver Not Loaded" in text:
        return "the NVIDIA driver is not loaded"
    return text


@dataclass
class HostReading:
    cpu_utilization: float      # 0..1, every core, since the previous reading
    cpu_count: int
    memory_used_bytes: int
    memory_total_bytes: int
    load_average_1m: float


class HostSource:
    """CPU and memory through psutil."""

    def __init__(self):
        import psutil

        self._psutil = psutil
        psutil.cpu_percent(None)  # the first call starts the interval the next one measures

    def read(self) -> HostReading:
        ps = self._psutil
        mem = ps.virtual_memory()
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = 0.0
        return HostReading(cpu_utilization=ps.cpu_percent(None) / 100.0,
                           cpu_count=ps.cpu_count() or os.cpu_count() or 1,
                           memory_used_bytes=int(mem.total - mem.available),
                           memory_total_bytes=int(mem.total), load_average_1m=float(load))


@dataclass
class JobTimes:
    """Where one job's time went on this agent."""
    job_id: str
    plugin: str
    load_s: float = 0.0
    run_s: float = 0.0
    upload_s: float = 0.0
    outcome: str = "done"
    request_id: str = ""


@dataclass
class TelemetrySample:
    sampled_at: float
    host: HostReading
    gpus: list[GpuReading]
    gpu_available: bool
    gpu_note: str
    jobs: list[JobTimes] = field(default_factory=list)


class Telemetry:
    """Samples the sources and holds finished jobs' timings until the next report.
    ``interval_s``: the least time between two reports in heartbeats."""

    def __init__(self, gpu: GpuSource | None = None, host: HostSource | None = None, *,
                 interval_s: float = 15.0, clock=time.time, monotonic=time.monotonic):
        self.gpu = gpu if gpu is not None else default_gpu_source()
        self.host = host if host is not None else HostSource()
        self.interval_s = interval_s
        self.clock = clock
        self.monotonic = monotonic
        self._jobs: deque[JobTimes] = deque(maxlen=MAX_JOB_TIMINGS)
        self._lock = threading.Lock()
        self._reported_at = float("-inf")
        self.listeners: list = []  # callables(JobTimes): the local /metrics
        if not self.gpu.available:
            log.info("telemetry: CPU and memory only (%s)", self.gpu.note)

    def job_finished(self, times: JobTimes) -> None:
        with self._lock:
            self._jobs.append(times)
        for listener in self.listeners:
            listener(times)

    def sample(self) -> TelemetrySample:
        return TelemetrySample(sampled_at=self.clock(), host=self.host.read(),
                               gpus=self.gpu.read(), gpu_available=self.gpu.available,
                               gpu_note=self.gpu.note)

    def due(self) -> TelemetrySample | None:
        """A report with the jobs finished since the last one, when ``interval_s`` has
        passed since then; else None."""
        now = self.monotonic()
        if now - self._reported_at < self.interval_s:
            return None
        self._reported_at = now
        sample = self.sample()
        with self._lock:
            sample.jobs = list(self._jobs)
            self._jobs.clear()
        return sample


def default_gpu_source() -> GpuSource:
    return NvmlGpuSource()


def to_proto(sample: TelemetrySample, pb):
    """``sample`` as a ``pb.Telemetry`` message (``pb``: sdk.protocol.agent_pb2)."""
    h = sample.host
    return pb.Telemetry(
        sampled_at=sample.sampled_at, cpu_utilization=h.cpu_utilization, cpu_count=h.cpu_count,
        memory_used_bytes=h.memory_used_bytes, memory_total_bytes=h.memory_total_bytes,
        load_average_1m=h.load_average_1m, gpu_available=sample.gpu_available,
        gpu_note=sample.gpu_note,
        gpus=[pb.GpuTelemetry(index=g.index, name=g.name, utilization=g.utilization,
                              memory_used_bytes=g.memory_used_bytes,
                              memory_total_bytes=g.memory_total_bytes,
                              temperature_c=g.temperature_c, power_w=g.power_w,
                              power_limit_w=g.power_limit_w) for g in sample.gpus],
        jobs=[pb.JobTiming(job_id=j.job_id, plugin=j.plugin, load_s=j.load_s, run_s=j.run_s,
                           upload_s=j.upload_s, outcome=j.outcome, request_id=j.request_id)
              for j in sample.jobs])
