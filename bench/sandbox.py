"""Cost of the plugin-host sandbox: start time and per-message round trip, with and without.

    .venv/bin/python bench/sandbox.py [--starts 10] [--round-trips 2000]

Start time is from ``Popen`` to the host's first line ("ready"): bwrap + seccomp + cgroup
setup + Python start.  Round trip is one line out and back over stdin/stdout pipes to a
warm host (a tiny echo loop), which is what a job pays once the host is warm; the target is
well under 5 ms.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from provider_agent.sandbox import Sandbox, SandboxPolicy  # noqa: E402

READY = "import sys; print('ready', flush=True)"
ECHO = ("import sys\nprint('ready', flush=True)\n"
        "for line in sys.stdin:\n    sys.stdout.write(line); sys.stdout.flush()\n")


def _start(argv, sandboxed: bool, policy: SandboxPolicy, n: int):
    sb = Sandbox(policy, f"bench-{n}") if sandboxed else None
    kwargs = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    t0 = time.perf_counter()
    proc = sb.popen(argv, **kwargs) if sb else subprocess.Popen(argv, **kwargs)
    assert proc.stdout.readline().strip() == "ready"
    return proc, sb, time.perf_counter() - t0


def start_times(policy: SandboxPolicy, sandboxed: bool, runs: int) -> list[float]:
    out = []
    for i in range(runs):
        proc, sb, dt = _start([sys.executable, "-c", READY], sandboxed, policy, i)
        proc.wait()
        if sb:
            sb.cleanup()
        out.append(dt)
    return out


def round_trip_s(policy: SandboxPolicy, sandboxed: bool, trips: int) -> float:
    proc, sb, _ = _start([sys.executable, "-c", ECHO], sandboxed, policy, 999)
    try:
        for _ in range(50):  # warm up
            proc.stdin.write("x\n"); proc.stdout.readline()
        t0 = time.perf_counter()
        for i in range(trips):
            proc.stdin.write(f"{i}\n")
            assert proc.stdout.readline() == f"{i}\n"
        return (time.perf_counter() - t0) / trips
    finally:
        proc.stdin.close()
        proc.wait()
        if sb:
            sb.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=10)
    ap.add_argument("--round-trips", type=int, default=2000)
    args = ap.parse_args()
    ok, reason = Sandbox.available()
    if not ok:
        print(f"sandbox unavailable: {reason}")
        return 1
    policy = SandboxPolicy.for_current_python([ROOT])
    plain = start_times(policy, False, args.starts)
    boxed = start_times(policy, True, args.starts)
    rt_plain = round_trip_s(policy, False, args.round_trips)
    rt_boxed = round_trip_s(policy, True, args.round_trips)
    sb = Sandbox(policy, "bench-enforcement")
    p = sb.popen([sys.executable, "-c", "pass"]); p.wait()
    enforcement = sb.enforcement
    sb.cleanup()

    med = statistics.median
    print(f"limits enforced by: {enforcement}")
    print(f"host start to ready (median of {args.starts}):")
    print(f"  plain     {med(plain) * 1e3:8.1f} ms   (min {min(plain) * 1e3:.1f})")
    print(f"  sandboxed {med(boxed) * 1e3:8.1f} ms   (min {min(boxed) * 1e3:.1f})")
    extra_ms = (med(boxed) - med(plain)) * 1e3
    print(f"  ratio     {med(boxed) / med(plain):8.2f}x   (+{extra_ms:.1f} ms)")
    print(f"round trip once warm ({args.round_trips} messages):")
    print(f"  plain     {rt_plain * 1e6:8.1f} us")
    print(f"  sandboxed {rt_boxed * 1e6:8.1f} us")
    print(f"  ratio     {rt_boxed / rt_plain:8.2f}x   (target < 5 ms per job: "
          f"{'met' if rt_boxed < 5e-3 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
