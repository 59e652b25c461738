"""AsyncClient against Client: N concurrent generate() calls (echo) through a real broker
and agent processes on loopback, as N tasks in one event loop and as N threads each with a
Client, measured in the same run. Prints wall time, jobs/s and this process's CPU per job.

    .venv/bin/python bench/sdk_clients.py --jobs 200 --slots 16
"""
from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdk import AsyncClient, Client  # noqa: E402
from sdk.localnet import LocalNetwork  # noqa: E402


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_async(url: str, key: str, n: int) -> tuple[float, float]:
    async def main():
        async with AsyncClient(url, key) as client:
            await client.generate("echo", text="warm")
            c0, t0 = cpu_s(), time.perf_counter()
            results = await asyncio.gather(*(client.generate("echo", text=str(i))
                                             for i in range(n)))
            took, cpu = time.perf_counter() - t0, cpu_s() - c0
            assert [r.json[0]["text"] for r in results] == [str(i) for i in range(n)]
            return took, cpu
    return asyncio.run(main())


def run_threads(url: str, key: str, n: int) -> tuple[float, float]:
    client = Client(url, key)
    client.generate("echo", text="warm")
    out: list = [None] * n

    def one(i):
        out[i] = client.generate("echo", text=str(i)).json[0]["text"]
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    c0, t0 = cpu_s(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took, cpu = time.perf_counter() - t0, cpu_s() - c0
    client.close()
    assert out == [str(i) for i in range(n)]
    return took, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=200, help="concurrent generate() calls")
    ap.add_argument("--slots", type=int, default=16, help="the agent's job slots")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of each")
    args = ap.parse_args()
    net = LocalNetwork(Path(tempfile.mkdtemp(prefix="sc-bench-sdk-")),
                       env={"SPARECYCLES_VERIFICATION": "off"})
    try:
        net.start_broker()
        net.start_agent("a0", net.create_key("provider"), plugins="echo", slots=args.slots,
                        sandbox=False)
        net.wait_for_providers(1)
        key = net.create_key("client", credits="1000000")
        figures = {"AsyncClient (1 loop)": [], "Client (N threads)": []}
        for _ in range(args.rounds):
            figures["AsyncClient (1 loop)"].append(run_async(net.url, key, args.jobs))
            figures["Client (N threads)"].append(run_threads(net.url, key, args.jobs))
        print(f"{args.jobs} concurrent generate() on echo, agent slots {args.slots}, "
              f"{args.rounds} rounds each (best shown)")
        best = {}
        for name, runs in figures.items():
            took, cpu = min(runs)
            best[name] = took
            print(f"  {name:<22} {took:6.2f} s  {args.jobs / took:6.0f} jobs/s  "
                  f"client CPU {1000 * cpu / args.jobs:5.2f} ms/job")
        a, t = best["AsyncClient (1 loop)"], best["Client (N threads)"]
        print(f"  ratio: AsyncClient takes {a / t:.2f}× the threads' wall time")
    finally:
        net.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
