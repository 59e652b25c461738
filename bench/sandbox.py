"""Cost of the plugin-host sandbox: host start time and per-job overhead, with and without.

    .venv/bin/python bench/sandbox.py [--starts 5] [--jobs 1000]

Both sides run the real thing: a ``PluginHost`` serving the built-in echo plugin, started
by ``provider_agent.launch.host_launcher`` (sandboxed: bubblewrap + seccomp + cgroup or
rlimit limits, as root the drop to the sandbox user, and the host's after-job sweep for
stray processes and for what a job left in the writable places; plain: the subprocess
``--no-sandbox`` gives). Start time is ``PluginHost.start()`` (process start, plugin
import, ready message). Per job is one ``run()`` on the warm host (the job frame out, the
output and result frames back), after a warm-up. Prints figures; asserts nothing (DESIGN
§1: no timed assertions). Target: under 5 ms per job once warm.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plugins import builtin_plugin_dir  # noqa: E402
from provider_agent.host.manager import PluginHost  # noqa: E402
from provider_agent.launch import host_launcher  # noqa: E402
from provider_agent.sandbox import Sandbox  # noqa: E402


_LAUNCHERS = []  # closed at the end: each holds the cgroup its hosts share


def _host(sandboxed: bool, home: Path) -> PluginHost:
    launcher = host_launcher(sandboxed=sandboxed, home=home)
    if launcher is not None:
        _LAUNCHERS.append(launcher)
    return PluginHost(builtin_plugin_dir("echo"), None, device="cpu", launcher=launcher)


def start_times(sandboxed: bool, home: Path, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        host = _host(sandboxed, home)
        t0 = time.perf_counter()
        host.start()
        out.append(time.perf_counter() - t0)
        host.stop()
    return out


def per_job_s(sandboxed: bool, home: Path, jobs: int) -> tuple[list[float], dict]:
    host = _host(sandboxed, home)
    host.start()
    inputs = {"text": "benchmark", "sleep_ms": 0, "steps": 1}
    try:
        for i in range(50):  # warm up
            host.run(f"warm-{i}", inputs, wall_clock_s=30)
        times = []
        for i in range(jobs):
            t0 = time.perf_counter()
            host.run(f"job-{i}", inputs, wall_clock_s=30)
            times.append(time.perf_counter() - t0)
        sandbox = getattr(host.proc, "sandbox", None)
        return times, (sandbox.enforcement if sandbox else {})
    finally:
        host.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=1000)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    ok, reason = Sandbox.available()
    if not ok:
        print(f"sandbox unavailable: {reason}")
        return 1
    med = statistics.median
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        plain_start = start_times(False, home, args.starts)
        boxed_start = start_times(True, home, args.starts)
        plain_jobs, _ = per_job_s(False, home, args.jobs)
        boxed_jobs, enforcement = per_job_s(True, home, args.jobs)
        for launcher in _LAUNCHERS:
            launcher.close()

    print(f"limits enforced by: {enforcement}")
    print(f"host start to ready, echo plugin (median of {args.starts}):")
    print(f"  plain     {med(plain_start) * 1e3:8.1f} ms   (min {min(plain_start) * 1e3:.1f})")
    print(f"  sandboxed {med(boxed_start) * 1e3:8.1f} ms   (min {min(boxed_start) * 1e3:.1f})")
    print(f"  ratio     {med(boxed_start) / med(plain_start):8.2f}x   "
          f"(+{(med(boxed_start) - med(plain_start)) * 1e3:.1f} ms)")
    print(f"per job on a warm host ({args.jobs} echo jobs):")
    for label, times in (("plain", plain_jobs), ("sandboxed", boxed_jobs)):
        p95 = sorted(times)[int(len(times) * 0.95)]
        print(f"  {label:<9} {med(times) * 1e3:8.3f} ms median, {p95 * 1e3:.3f} ms p95, "
              f"{len(times) / sum(times):8.0f} jobs/s")
    overhead_ms = (med(boxed_jobs) - med(plain_jobs)) * 1e3
    print(f"  ratio     {med(boxed_jobs) / med(plain_jobs):8.2f}x   (+{overhead_ms:.3f} ms per "
          f"job; target < 5 ms per job: {'met' if med(boxed_jobs) < 5e-3 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
