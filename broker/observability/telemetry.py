"""Agents' telemetry as the broker keeps it (issue #25): each provider's latest report
(GPUs, CPU, memory), received in a heartbeat on the replica that holds its stream.

The replica keeps the latest report of each agent it holds in memory (exported in its
``/metrics`` per provider, forgotten when the stream ends so no stale series linger) and
writes it to the provider's row at most every ``persist_s``, so the console on any replica
shows it (with its age). Job timings in the report feed a histogram of where providers'
jobs spend their time (load, run, upload) per plugin.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Protocol

from prometheus_client import Histogram
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger(__name__)

PHASE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
MAX_GPUS = 16          # per report (more are left out)
MAX_TEXT = 200         # characters of a GPU's name or the note kept


class TelemetryRepository(Protocol):
    def record_telemetry(self, provider_id: str, telemetry: dict, at: float) -> None: ...


def _clean(x: float, lo: float = 0.0, hi: float = float("inf")) -> float | None:
    """A figure from an agent as the broker keeps it: within [lo, hi], or None (unknown)
    when it is not a number or is infinite: an agent that cannot read its GPU's
    temperature must not show as running at the bound."""
    x = float(x)
    if not math.isfinite(x):
        return None
    return min(hi, max(lo, x))


def _whole(x: int, hi: int) -> int:
    """An integer figure from an agent (always finite on the wire), within [0, hi]."""
    return min(hi, max(0, int(x)))


def report_dict(t) -> dict:
    """A ``pb.Telemetry`` as JSON the console and the database keep (figures clamped to
    what they can be, a non-finite one kept as None: an agent's report is not trusted to
    be sane)."""
    return {
        "sampled_at": _clean(t.sampled_at),
        "cpu_utilization": _clean(t.cpu_utilization, 0.0, 1.0),
        "cpu_count": _whole(t.cpu_count, 1 << 16),
        "memory_used_bytes": _whole(t.memory_used_bytes, 1 << 60),
        "memory_total_bytes": _whole(t.memory_total_bytes, 1 << 60),
        "load_average_1m": _clean(t.load_average_1m, 0.0, 1e6),
        "gpu_available": bool(t.gpu_available),
        "gpu_note": t.gpu_note[:MAX_TEXT],
        "gpus": [{"index": _whole(g.index, 1 << 16), "name": g.name[:MAX_TEXT],
                  "utilization": _clean(g.utilization, 0.0, 1.0),
                  "memory_used_bytes": _whole(g.memory_used_bytes, 1 << 60),
                  "memory_total_bytes": _whole(g.memory_total_bytes, 1 << 60),
                  "temperature_c": _clean(g.temperature_c, -100.0, 300.0),
                  "power_w": _clean(g.power_w, 0.0, 1e5),
                  "power_limit_w": _clean(g.power_limit_w, 0.0, 1e5)}
                 for g in list(t.gpus)[:MAX_GPUS]],
    }


class TelemetryStore:
    """The latest telemetry of the agents this replica holds (see the module docstring).
    ``registry``: where the job-phase histogram is registered (the broker's metrics)."""

    def __init__(self, repo: TelemetryRepository, *, registry=None, persist_s: float = 60.0,
                 clock=time.time):
        self.repo = repo
        self.persist_s = persist_s
        self.clock = clock
        self._latest: dict[str, tuple[str, dict, float]] = {}  # id -> (name, report, at)
        self._persisted_at: dict[str, float] = {}
        self._lock = threading.Lock()
        self.phase = Histogram(
            "sparecycles_provider_job_phase_seconds", "Where providers' jobs spent their "
            "time, as their agents report it: load (adapters, checkpoint), run (the plugin "
            "host), upload (outputs and receipt until the broker's ack), by plugin.",
            ["plugin", "phase"], buckets=PHASE_BUCKETS_S,
            registry=registry) if registry is not None else None

    def record(self, provider_id: str, name: str, telemetry, plugins=()) -> None:
        """A heartbeat's ``pb.Telemetry`` from ``provider_id`` (in the agents' pool).
        ``plugins``: the plugin names it serves; job timings naming another plugin are
        counted as "other" (an agent must not mint label values)."""
        report = report_dict(telemetry)
        now = self.clock()
        with self._lock:
            self._latest[provider_id] = (name, report, now)
            due = now - self._persisted_at.get(provider_id, float("-inf")) >= self.persist_s
            if due:
                self._persisted_at[provider_id] = now
        if self.phase is not None:
            for j in list(telemetry.jobs)[:256]:
                plugin = j.plugin if j.plugin in plugins else "other"
                for phase, seconds in (("load", j.load_s), ("run", j.run_s),
                                       ("upload", j.upload_s)):
                    if seconds > 0 or phase == "run":
                        seconds = _clean(seconds, 0.0, 1e7)
                        if seconds is not None:
                            self.phase.labels(plugin, phase).observe(seconds)
        if due:
            try:
                self.repo.record_telemetry(provider_id, report, now)
            except Exception:  # noqa: BLE001 - the next report tries again
                log.exception("could not keep the telemetry of provider %s", provider_id)
                with self._lock:
                    self._persisted_at.pop(provider_id, None)

    def forget(self, provider_id: str) -> None:
        """The agent's stream ended: its series go (its row keeps the last report)."""
        with self._lock:
            latest = self._latest.pop(provider_id, None)
            self._persisted_at.pop(provider_id, None)
        if latest is not None:  # the newest report, not the last persisted one
            try:
                self.repo.record_telemetry(provider_id, latest[1], latest[2])
            except Exception:  # noqa: BLE001
                log.exception("could not keep the telemetry of provider %s", provider_id)

    def latest(self, provider_id: str) -> tuple[dict, float] | None:
        """(report, when it came) held here, or None (the row may have an older one)."""
        with self._lock:
            got = self._latest.get(provider_id)
        return None if got is None else (got[1], got[2])

    def collect(self):
        """Per provider gauges of the agents this replica holds (at scrape time)."""
        with self._lock:
            latest = list(self._latest.items())
        labels = ["provider", "name"]
        fams = {
            "cpu": GaugeMetricFamily("sparecycles_provider_cpu_utilization_ratio",
                                     "A provider machine's CPU busy, 0..1.", labels=labels),
            "mem": GaugeMetricFamily("sparecycles_provider_memory_used_bytes",
                                     "A provider machine's memory in use.", labels=labels),
            "memt": GaugeMetricFamily("sparecycles_provider_memory_total_bytes",
                                      "A provider machine's memory installed.", labels=labels),
            "gpus": GaugeMetricFamily("sparecycles_provider_gpus", "GPUs a provider's agent "
                                      "reads through NVML (0: CPU only).", labels=labels),
            "age": GaugeMetricFamily("sparecycles_provider_telemetry_age_seconds",
                                     "Seconds since the provider's latest report.",
                                     labels=labels),
        }
        glabels = ["provider", "name", "gpu", "model"]
        gpu_fams = {
            "utilization": GaugeMetricFamily("sparecycles_provider_gpu_utilization_ratio",
                                             "A provider GPU's busy time, 0..1 (NVML).",
                                             labels=glabels),
            "memory_used_bytes": GaugeMetricFamily(
                "sparecycles_provider_gpu_memory_used_bytes", "A provider GPU's memory in "
                "use.", labels=glabels),
            "memory_total_bytes": GaugeMetricFamily(
                "sparecycles_provider_gpu_memory_total_bytes", "A provider GPU's memory.",
                labels=glabels),
            "temperature_c": GaugeMetricFamily(
                "sparecycles_provider_gpu_temperature_celsius", "A provider GPU's "
                "temperature.", labels=glabels),
            "power_w": GaugeMetricFamily("sparecycles_provider_gpu_power_watts",
                                         "A provider GPU's power draw.", labels=glabels),
        }
        now = self.clock()
        for pid, (name, r, at) in latest:
            if r["cpu_utilization"] is not None:  # None: unknown, no sample
                fams["cpu"].add_metric([pid, name], r["cpu_utilization"])
            fams["mem"].add_metric([pid, name], r["memory_used_bytes"])
            fams["memt"].add_metric([pid, name], r["memory_total_bytes"])
            fams["gpus"].add_metric([pid, name], len(r["gpus"]))
            fams["age"].add_metric([pid, name], max(0.0, now - at))
            for g in r["gpus"]:
                for key, fam in gpu_fams.items():
                    if g[key] is not None:
                        fam.add_metric([pid, name, str(g["index"]), g["name"]], g[key])
        yield from fams.values()
        yield from gpu_fams.values()
