"""Fault benchmark: the extra time a job takes when its provider dies half-way, with and
without checkpoints (DESIGN §2).

For each mode it starts a real broker and two real agents on loopback (localnet), runs one
job uninterrupted (the baseline), then the same job again and SIGKILLs the agent running it
as soon as it reports 50 % progress; the broker notices when the lease expires and moves
the job to the other agent, which resumes from the last checkpoint (mode "checkpoints") or
starts over (mode "none"). Prints the baseline, the total with the kill, and the extra time,
which is about: lease timeout + agent fetch/start + the work lost (since the last
checkpoint, or everything done so far without one).

    python bench/faults.py [--plugin echo|sd15] [--seconds 8] [--steps 20] [--every 2]
                           [--lease 2] [--repeat 2]
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdk import Client  # noqa: E402
from sdk.localnet import LocalNetwork, cli  # noqa: E402

SANDBOX = shutil.which("bwrap") is not None


def job_inputs(args, i: int) -> dict:
    if args.plugin == "echo":
        return dict(text=f"fault {i}", sleep_ms=int(args.seconds * 1000), steps=args.steps)
    return dict(prompt="a lighthouse at dusk", seed=i, steps=args.steps, width=args.size,
                height=args.size)


def run_mode(args, mode: str, weights: Path | None, workdir: Path) -> tuple[list, list]:
    env = {"SPARECYCLES_CHECKPOINT_EVERY_STEPS": str(args.every),
           "SPARECYCLES_CHECKPOINT_MIN_STEPS": "2" if mode == "checkpoints" else "1000000",
           "SPARECYCLES_MARKET_CLAIM_FACTOR": "1", "SPARECYCLES_VERIFICATION": "off"}
    net = LocalNetwork(workdir / mode, lease_timeout_s=args.lease, env=env)
    base, killed = [], []
    try:
        net.start_broker()
        agents = [net.start_agent(n, net.create_key("provider", n), plugins=args.plugin,
                                  weights_dir=weights, sandbox=SANDBOX) for n in ("a", "b")]
        net.wait_for_providers(2)
        client = Client(net.url, net.create_key("client", credits="1000000"))
        client.jobs.create(args.plugin, **job_inputs(args, 999)).wait(timeout=600)  # warm-up
        for r in range(args.repeat):
            t = time.perf_counter()
            client.jobs.create(args.plugin, **job_inputs(args, r)).wait(timeout=600)
            base.append(time.perf_counter() - t)

            t = time.perf_counter()
            job = client.jobs.create(args.plugin, **job_inputs(args, 100 + r))
            for ev in job.events():
                if ev.kind == "progress" and ev.data.get("total") and \
                        ev.data["step"] * 2 >= ev.data["total"]:
                    break
            victim_id = job.refresh().data["provider_id"]
            victim = next(a for a in agents if victim_id in a.log_path.read_text())
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait(10)
            job.wait(timeout=600)
            killed.append(time.perf_counter() - t)
            net.restart_agent(victim)
            net.wait_for_providers(2)
        client.close()
    finally:
        net.stop()
    return base, killed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plugin", choices=["echo", "sd15"], default="echo")
    ap.add_argument("--seconds", type=float, default=8.0, help="echo: job duration")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=2, help="checkpoint every N steps")
    ap.add_argument("--size", type=int, default=128, help="sd15: image width and height")
    ap.add_argument("--lease", type=float, default=2.0, help="lease timeout (s)")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sc-faults-"))
    weights = None
    try:
        if args.plugin == "sd15":
            weights = work / "weights"
            subprocess.run(cli("plugins", "build-tiny", "sd15", "--out", str(weights / "sd15")),
                           check=True, capture_output=True)
        print(f"plugin {args.plugin}, {args.steps} steps, checkpoint every {args.every}, lease "
              f"timeout {args.lease:g}s, provider SIGKILLed at 50 %, {args.repeat} run(s)")
        print(f"{'mode':<12} {'baseline s':>11} {'with kill s':>12} {'extra s':>8} "
              f"{'extra %':>8}")
        for mode in ("none", "checkpoints"):
            base, killed = run_mode(args, mode, weights, work)
            b, k = statistics.median(base), statistics.median(killed)
            print(f"{mode:<12} {b:>11.2f} {k:>12.2f} {k - b:>8.2f} {100 * (k - b) / b:>7.0f}%")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
