"""Per plugin on tiny weights, through the real plugin-host process: cold start, warm job
latency, and swapping a LoRA adapter on the warm model versus reloading the base model.

    .venv/bin/python bench/plugins.py [--plugins sd15,sdxl,llama] [--jobs 5] [--device cpu]
                                      [--workdir DIR] [--sandbox]

For each plugin the weights and two LoRA adapters are built with the real command
(`sparecycles plugins build-tiny KIND --out DIR`, adapters under ``<weights>/adapters/``),
then a ``PluginHost`` (provider_agent.host.manager) is started the way the agent starts it:

* **cold start** — ``PluginHost.start()``: process start, imports, model load, Ready
  (``load`` is the model-load part the host reports);
* **first job** — the first run in a fresh process (warm-up: several times slower);
* **warm job** — median of ``--jobs`` runs of the same small job on the warm host;
* **adapter load** — a job naming an adapter not yet loaded, minus the warm job: reading it
  from disk into the warm model;
* **adapter swap** — median of jobs alternating two adapters already in the host's adapter
  cache, minus the warm job: what a job with another adapter costs on a warm model;
* **base reload** — stopping the host and starting it again (process + model load): what
  the swap would cost if a model had to be reloaded for each adapter.

Jobs: SD 4 steps at 64×64 (seed 1), Llama 8 new tokens (greedy). Prints a table; asserts
nothing (DESIGN §1). Hosts run with OMP_NUM_THREADS=1 unless --threads says otherwise.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plugins import builtin_plugin_dir  # noqa: E402
from provider_agent.host.manager import PluginHost  # noqa: E402

JOBS = {
    "sd15": {"prompt": "a red cube", "steps": 4, "width": 64, "height": 64, "seed": 1},
    "sdxl": {"prompt": "a red cube", "steps": 4, "width": 64, "height": 64, "seed": 1},
    "llama": {"prompt": "Once upon a time", "max_new_tokens": 8, "temperature": 0.0,
              "ignore_eos": True, "seed": 0},
}
ADAPTERS = ("ink", "film")


def build(kind: str, out: Path, seed: int = 0) -> float:
    """`sparecycles plugins build-tiny KIND --out OUT`; returns seconds (0 when built)."""
    if (out / "sparecycles-tiny.json").exists():
        return 0.0
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "sdk.cli", "plugins", "build-tiny", kind,
                    "--out", str(out), "--seed", str(seed)], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def prepare(plugin: str, workdir: Path) -> Path:
    weights = workdir / plugin
    build(plugin, weights)
    for seed, name in enumerate(ADAPTERS, start=1):
        build(f"lora-{plugin}", weights / "adapters" / name, seed=seed)
    return weights


def _launcher(sandboxed: bool, weights: Path, home: Path):
    if not sandboxed:
        return None
    from provider_agent.launch import host_launcher

    return host_launcher(sandboxed=True, home=home)  # binds the plugin's own weights


def _run(host: PluginHost, inputs: dict) -> float:
    t0 = time.perf_counter()
    host.run(f"bench-{time.monotonic_ns()}", inputs, wall_clock_s=600)
    return (time.perf_counter() - t0) * 1000


def bench_plugin(plugin: str, weights: Path, jobs: int, device: str, sandboxed: bool,
                 home: Path) -> dict:
    job = JOBS[plugin]
    host = PluginHost(builtin_plugin_dir(plugin), weights, device=device,
                      launcher=_launcher(sandboxed, weights, home))
    t0 = time.perf_counter()
    ready = host.start()
    cold_s = time.perf_counter() - t0
    try:
        first_ms = _run(host, job)
        warm = [_run(host, job) for _ in range(jobs)]
        warm_ms = statistics.median(warm)
        load_ms = _run(host, {**job, "adapters": ADAPTERS[0]}) - warm_ms
        _run(host, {**job, "adapters": ADAPTERS[1]})  # both now in the adapter cache
        swaps = [_run(host, {**job, "adapters": ADAPTERS[i % 2]}) for i in range(jobs * 2)]
        swap_ms = statistics.median(swaps) - warm_ms
    finally:
        host.stop()
    reload_t0 = time.perf_counter()
    again = PluginHost(builtin_plugin_dir(plugin), weights, device=device,
                       launcher=_launcher(sandboxed, weights, home))
    again.start()
    reload_s = time.perf_counter() - reload_t0
    again.stop()
    return {"plugin": plugin, "device": ready.get("hardware", {}).get("device", device),
            "cold_s": cold_s, "load_s": ready.get("load_ms", 0) / 1000, "first_ms": first_ms,
            "warm_ms": warm_ms, "adapter_load_ms": load_ms, "swap_ms": swap_ms,
            "reload_s": reload_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plugins", default="sd15,sdxl,llama")
    ap.add_argument("--jobs", type=int, default=5, help="timed jobs per figure (median)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, auto")
    ap.add_argument("--workdir", type=Path, help="where the tiny weights go (kept; default "
                                                 "a temporary folder)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the hosts")
    ap.add_argument("--sandbox", action="store_true", help="start hosts in the sandbox")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["MKL_NUM_THREADS"] = str(args.threads)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sparecycles-bench-plugins-"))
    home = Path(tempfile.mkdtemp(prefix="sparecycles-bench-home-"))
    rows = []
    for plugin in [p.strip() for p in args.plugins.split(",") if p.strip()]:
        t0 = time.perf_counter()
        weights = prepare(plugin, workdir)
        print(f"{plugin}: tiny weights and 2 adapters ready in {time.perf_counter() - t0:.1f} s "
              f"({weights})", file=sys.stderr)
        rows.append(bench_plugin(plugin, weights, args.jobs, args.device, args.sandbox, home))
    print(f"\nplugin host per plugin on tiny weights ({'sandboxed' if args.sandbox else 'plain'}"
          f" subprocess, OMP_NUM_THREADS={args.threads}, {args.jobs} timed jobs per median)")
    head = (f"{'plugin':7} {'device':6} {'cold start':>11} {'(load)':>8} {'first job':>10} "
            f"{'warm job':>9} {'adapter load':>13} {'adapter swap':>13} {'base reload':>12}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['plugin']:7} {r['device']:6} {r['cold_s']:>9.2f} s {r['load_s']:>6.2f} s "
              f"{r['first_ms']:>7.0f} ms {r['warm_ms']:>6.0f} ms {r['adapter_load_ms']:>10.0f} ms "
              f"{r['swap_ms']:>10.0f} ms {r['reload_s']:>10.2f} s")
    print("\nadapter swap = a job alternating two cached adapters minus a plain warm job; "
          "base reload = restarting the host (process + model load)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
