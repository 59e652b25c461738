"""The agent's own benchmark of each plugin it serves: the manifest's benchmark payload,
one warm-up run dropped, then several timed runs; the median rate in work units per second.

The figure is a claim the agent reports at connect (``Capabilities.benchmarks``); the broker
matches on what it measures itself (real jobs and canaries) once it has that.
"""
from __future__ import annotations

import logging
import statistics
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("agent.benchmark")


@dataclass(frozen=True)
class BenchmarkResult:
    plugin: str
    units_per_s: float
    runs: int
    work_units: float


def benchmark_plugin(served, *, runs: int = 3, throttle_ms_per_unit: float = 0.0) -> BenchmarkResult | None:
    """Time ``served`` (an agent's ServedPlugin with a started host). None when the plugin
    has no benchmark payload or the run fails (the agent then reports no claim)."""
    manifest = served.manifest
    try:
        inputs = manifest.validate_inputs(dict(manifest.benchmark_inputs))
        work_units = manifest.work_units_for(inputs)
    except Exception as exc:  # noqa: BLE001 - a manifest without a usable benchmark
        log.warning("%s: no benchmark (%s)", manifest.ref, exc)
        return None
    rates = []
    for i in range(runs + 1):
        t0 = time.perf_counter()
        try:
            result = served.host.run(f"benchmark-{manifest.name}-{i}", inputs,
                                     wall_clock_s=manifest.wall_clock_s,
                                     on_progress=lambda *a: None, on_stream=lambda *a: None,
                                     cancelled=threading.Event())
        except Exception as exc:  # noqa: BLE001
            log.warning("%s: benchmark run failed: %s", manifest.ref, exc)
            return None
        units = float(result.work_units or work_units)
        throttle(throttle_ms_per_unit, units)
        elapsed = time.perf_counter() - t0
        if i == 0:
            continue  # warm-up: caches, lazy init
        rates.append(units / max(elapsed, 1e-3))
    rate = statistics.median(rates)
    log.info("benchmark %s: %.3g work units/s (%d runs of %g units)", manifest.ref, rate, runs,
             work_units)
    return BenchmarkResult(manifest.name, rate, runs, work_units)


def throttle(ms_per_unit: float, work_units: float) -> float:
    """Emulate a slower machine (development and tests): wait ``ms_per_unit`` per work
    unit. Returns the ms waited."""
    if ms_per_unit <= 0:
        return 0.0
    wait_ms = ms_per_unit * work_units
    time.sleep(wait_ms / 1000.0)
    return wait_ms
