"""The agent's own benchmark of each plugin it serves: the manifest's benchmark payload,
one warm-up run dropped, then several timed runs; the median rate in work units per second.

The figure is a claim the agent reports at connect (``Capabilities.benchmarks``); the broker
matches on what it measures itself (real jobs and canaries) once it has that.

The runs come before the agent connects and may take minutes on a CPU, so the agent says
what it is doing: a line when a plugin's benchmark starts, an estimate of how long it
takes once its first step is done, then its progress: a tqdm bar when stderr is a
terminal, a log line every ``LOG_EVERY_S`` otherwise (the plugin's own progress steps;
whole runs for a plugin that reports none).
"""
from __future__ import annotations

import logging
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, TextIO

log = logging.getLogger("agent.benchmark")
LOG_EVERY_S = 10.0  # how often a benchmark logs its progress when stderr is no terminal


@dataclass(frozen=True)
class BenchmarkResult:
    plugin: str
    units_per_s: float
    runs: int
    work_units: float


def benchmark_plugin(served, *, runs: int = 3, throttle_ms_per_unit: float = 0.0,
                     progress: "BenchmarkProgress | None" = None) -> BenchmarkResult | None:
    """Time ``served`` (an agent's ServedPlugin with a started host). None when the plugin
    has no benchmark payload or the run fails (the agent then reports no claim).
    ``progress`` reports how far it is (default: a :class:`BenchmarkProgress` on stderr)."""
    manifest = served.manifest
    try:
        # the weights' own defaults (an image model's size) for what the payload leaves out
        inputs = manifest.validate_inputs(dict(manifest.benchmark_inputs),
                                          getattr(served.host, "ready", {}).get("input_defaults"))
        work_units = manifest.work_units_for(inputs)
    except Exception as exc:  # noqa: BLE001 - a manifest without a usable benchmark
        log.warning("%s: no benchmark (%s)", manifest.ref, exc)
        return None
    payload = ", ".join(f"{k}={v}" for k, v in sorted(manifest.benchmark_inputs.items())
                        if not isinstance(v, str))
    log.info("benchmarking %s before connecting: 1 warm-up run and %d timed runs of its "
             "benchmark (%s; %g work units each) give the rate the broker is told; an "
             "estimate of the time follows its first step", manifest.ref, runs,
             payload or "its benchmark inputs", work_units)
    progress = progress or BenchmarkProgress(manifest.ref, runs + 1)
    rates = []
    try:
        for i in range(runs + 1):
            t0 = time.perf_counter()
            progress.run_started(i)
            try:
                result = served.host.run(f"benchmark-{manifest.name}-{i}", inputs,
                                         wall_clock_s=manifest.wall_clock_s,
                                         on_progress=progress.step, on_stream=lambda *a: None,
                                         cancelled=threading.Event())
            except Exception as exc:  # noqa: BLE001
                log.warning("%s: benchmark run failed: %s", manifest.ref, exc)
                return None
            units = float(result.work_units or work_units)
            throttle(throttle_ms_per_unit, units)
            elapsed = time.perf_counter() - t0
            progress.run_done(i)
            if i == 0:
                continue  # warm-up: caches, lazy init
            rates.append(units / max(elapsed, 1e-3))
    finally:
        progress.close()
    rate = statistics.median(rates)
    log.info("benchmark %s: %.3g work units/s (%d runs of %g units; %s in all)", manifest.ref,
             rate, runs, work_units, _duration(progress.elapsed_s()))
    return BenchmarkResult(manifest.name, rate, runs, work_units)


class BenchmarkProgress:
    """How far one plugin's benchmark is: ``runs`` runs, each reporting ``step(step,
    total)`` as the plugin makes progress. On a terminal (``stream.isatty()``) a tqdm bar
    over the runs; otherwise log lines: an estimate after the first step, then one every
    ``log_every_s`` with the run, the step, the time so far and the time left."""

    def __init__(self, ref: str, runs: int, *, stream: TextIO | None = None,
                 log_every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.ref, self.runs = ref, runs
        self.stream = stream if stream is not None else sys.stderr
        self.log_every_s = log_every_s
        self.clock = clock
        self.started = clock()
        self.run = 0                  # the run under way (0: the warm-up)
        self.fraction = 0.0           # of all runs, done
        self.estimated = False        # the first estimate was given
        self._last_log = self.started
        self._bar = None
        self._redirect = None
        isatty = getattr(self.stream, "isatty", None)
        if isatty is not None and isatty():
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=float(runs), desc=self._desc(0), unit="run",
                             file=self.stream, leave=True, dynamic_ncols=True,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| "
                                        "[{elapsed}<{remaining}]")
            # log lines (other threads, the host's) print above the bar, not through it
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()

    def elapsed_s(self) -> float:
        return self.clock() - self.started

    def left_s(self) -> float | None:
        if self.fraction <= 0:
            return None
        return self.elapsed_s() * (1 - self.fraction) / self.fraction

    def run_started(self, run: int) -> None:
        self.run = run
        if self._bar is not None:
            self._bar.set_description_str(self._desc(run))

    def _desc(self, run: int) -> str:
        return f"benchmark {self.ref} (run {run + 1} of {self.runs})"

    def step(self, step: int, total: int, message: str = "") -> None:
        if total > 0:
            self._advance((self.run + min(step, total) / total) / self.runs,
                          f"run {self.run + 1} of {self.runs}, step {step} of {total}")

    def run_done(self, run: int) -> None:
        self._advance((run + 1) / self.runs, f"run {run + 1} of {self.runs} done")

    def _advance(self, fraction: float, where: str) -> None:
        self.fraction = max(self.fraction, min(1.0, fraction))
        if self._bar is not None:
            self._bar.n = self.fraction * self.runs
            self._bar.refresh()
            return
        now = self.clock()
        if self.fraction >= 1.0:
            return  # the result line says it is done
        if not self.estimated:
            self.estimated = True
            self._last_log = now
            log.info("benchmark %s: about %s in all (estimated from %s, %s so far)", self.ref,
                     _duration(self.elapsed_s() + (self.left_s() or 0)), where,
                     _duration(self.elapsed_s()))
        elif now - self._last_log >= self.log_every_s:
            self._last_log = now
            log.info("benchmark %s: %s; %s so far, about %s left", self.ref, where,
                     _duration(self.elapsed_s()), _duration(self.left_s() or 0))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._redirect.__exit__(None, None, None)
            self._bar = self._redirect = None


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min"


def throttle(ms_per_unit: float, work_units: float) -> float:
    """Emulate a slower machine (development and tests): wait ``ms_per_unit`` per work
    unit. Returns the ms waited."""
    if ms_per_unit <= 0:
        return 0.0
    wait_ms = ms_per_unit * work_units
    time.sleep(wait_ms / 1000.0)
    return wait_ms
