"""The agent's telemetry (issue #25): what its GPUs, CPU and memory are doing and how long
each job spent loading, running and uploading. Sent to the broker in heartbeats (at most
once per ``interval_s``), and served on an optional agent-local ``/metrics``.

GPUs are read through the agent's one NVML source (provider_agent.gpu_usage: the
:class:`~provider_agent.gpu_usage.GpuUsageSource` idle detection reads too), for the
agent's own device only: one agent serves one GPU, so a machine's GPUs are each reported
once, by the agent serving it. Tests run the same code over a fake NVML module
(tests/unit/provider_agent/test_telemetry.py) where no GPU exists, and over the real
library where one does (the ``gpu`` marker). Without a GPU (no library, no driver, no
device, a CPU device) the agent reports its CPU and memory and says why there is no GPU
figure (``gpu_note``). A figure NVML cannot give is sent as NaN, which the broker keeps as
unknown. CPU and memory come from ``psutil``.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from .gpu_usage import DeviceUsage, GpuUsageSource

log = logging.getLogger("agent.telemetry")

MAX_JOB_TIMINGS = 64  # job timings held for the next report (older ones are dropped)


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
    gpus: list[DeviceUsage]
    gpu_available: bool
    gpu_note: str
    jobs: list[JobTimes] = field(default_factory=list)


class Telemetry:
    """Samples the sources and holds finished jobs' timings until the next report.
    ``gpu``: the agent's GPU source (its own device's, shared with its idle detection);
    ``interval_s``: the least time between two reports in heartbeats."""

    def __init__(self, gpu: GpuUsageSource, host: HostSource | None = None, *,
                 interval_s: float = 15.0, clock=time.time, monotonic=time.monotonic):
        self.gpu = gpu
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
                               gpus=self.gpu.sample(), gpu_available=self.gpu.available,
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


def utilization_ratio(gpu: DeviceUsage) -> float | None:
    """NVML's busy percentage as the 0..1 ratio the reports carry (None: unknown)."""
    return None if gpu.utilisation_pct is None else gpu.utilisation_pct / 100.0


def _figure(value: float | None) -> float:
    return float("nan") if value is None else float(value)  # NaN on the wire: unknown


def to_proto(sample: TelemetrySample, pb):
    """``sample`` as a ``pb.Telemetry`` message (``pb``: sdk.protocol.agent_pb2)."""
    h = sample.host
    return pb.Telemetry(
        sampled_at=sample.sampled_at, cpu_utilization=h.cpu_utilization, cpu_count=h.cpu_count,
        memory_used_bytes=h.memory_used_bytes, memory_total_bytes=h.memory_total_bytes,
        load_average_1m=h.load_average_1m, gpu_available=sample.gpu_available,
        gpu_note=sample.gpu_note,
        gpus=[pb.GpuTelemetry(index=g.index, name=g.name,
                              utilization=_figure(utilization_ratio(g)),
                              memory_used_bytes=g.memory_used_bytes or 0,
                              memory_total_bytes=g.memory_total_bytes or 0,
                              temperature_c=_figure(g.temperature_c),
                              power_w=_figure(g.power_w),
                              power_limit_w=_figure(g.power_limit_w)) for g in sample.gpus],
        jobs=[pb.JobTiming(job_id=j.job_id, plugin=j.plugin, load_s=j.load_s, run_s=j.run_s,
                           upload_s=j.upload_s, outcome=j.outcome, request_id=j.request_id)
              for j in sample.jobs])
