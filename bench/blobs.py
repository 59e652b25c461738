"""Blob bench (issue #24): large outputs through the broker's stream vs straight to S3.

Same run, same machine, same jobs: a real broker process, in-process agents serving the
bench-only ``blob`` plugin (bench/plugins/blob: ``size_kib`` KiB of seeded bytes per job), a
closed loop of clients, and
  * ``stream``: the local blob folder; outputs travel agent → broker on the gRPC stream and
    the client downloads them from the broker (``GET /v1/jobs/<id>/outputs/0``);
  * ``s3``: an S3 API in its own process (moto's server, tests/s3_server.py); agents PUT with
    presigned URLs pinned to the SHA-256, the broker HEADs each object's checksum, the
    client downloads with the presigned GET.
Prints jobs/s, CPU ms per job of the broker, the S3 server and this process (clients and
agents), the bytes the broker process read and wrote per job (files and sockets), and the
broker's CPU ratio s3 ÷ stream.

    python bench/blobs.py [--jobs 200] [--clients 8] [--slots 4] [--size-kib 1024]
                          [--no-download] [--rounds 1]
"""
from __future__ import annotations

import argparse
import logging
import hashlib
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.dispatch import _cpu_s  # noqa: E402
from sdk import Client  # noqa: E402
from sdk.localnet import LocalNetwork  # noqa: E402
from tests.s3_server import S3Server  # noqa: E402

BLOB_PLUGIN = ROOT / "bench" / "plugins" / "blob"
S3_KEYS = {"AWS_ACCESS_KEY_ID": "sparecycles-bench", "AWS_SECRET_ACCESS_KEY": "sparecycles-bench"}


def io_bytes(pid: int) -> int:
    """Bytes a process read and wrote through system calls (files and sockets alike:
    /proc/<pid>/io rchar + wchar)."""
    try:
        fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        return int(fields["rchar"]) + int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return 0


def start_agents(net: LocalNetwork, n: int, slots: int):
    """In-process agents (plain subprocess plugin hosts) serving the blob plugin."""
    from provider_agent.agent import Agent
    from provider_agent.config import AgentConfig
    from sdk.protocol.signing import KeyPair

    key = net.create_key("provider")
    agents = []
    for i in range(n):
        cfg = AgentConfig(broker=net.info["grpc"], api_key=key, name=f"bench-{i}", slots=slots,
                          plugins=["blob"], device="cpu")
        agent = Agent(cfg, KeyPair.generate(), plugin_dirs={"blob": BLOB_PLUGIN},
                      sandboxed=False)
        t = threading.Thread(target=agent.run, daemon=True)
        t.start()
        agents.append((agent, t))
    deadline = time.monotonic() + 120
    while not all(a.provider_id for a, _ in agents):
        if time.monotonic() > deadline:
            raise RuntimeError("the bench agents did not connect within 120 s")
        time.sleep(0.05)
    return agents


def run_mode(mode: str, s3: S3Server | None, args) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"sc-bench-blobs-{mode}-"))
    env = {"SPARECYCLES_VERIFICATION": "off",
           "SPARECYCLES_PLUGIN_DIRS": f"{ROOT / 'plugins'}:{ROOT / 'bench' / 'plugins'}"}
    if mode == "s3":
        env.update({"SPARECYCLES_BLOB_STORE": "s3", "SPARECYCLES_S3_BUCKET":
                    f"sc-bench-{uuid.uuid4().hex[:12]}", "SPARECYCLES_S3_ENDPOINT": s3.endpoint,
                    "SPARECYCLES_S3_REGION": "us-east-1", "SPARECYCLES_S3_PATH_STYLE": "on",
                    **S3_KEYS})
    net = LocalNetwork(work, env=env)
    agents = []
    try:
        net.start_broker()
        agents = start_agents(net, args.agents, args.slots)
        ckey = net.create_key("client", credits="1000000")
        seeds = iter(range(10**9))
        lock = threading.Lock()

        def one(c: Client) -> int:
            with lock:
                seed = next(seeds)
            r = c.generate("blob", seed=seed, size_kib=args.size_kib, timeout=120)
            if args.download:
                data = r.output_bytes(0)
                assert hashlib.sha256(data).hexdigest() == r.outputs[0]["sha256"]
                assert len(data) == args.size_kib * 1024
            return 1

        with Client(net.url, ckey) as c:
            for _ in range(5):  # warm-up: connections, first-call paths
                one(c)
        done = 0
        per_client = max(1, args.jobs // args.clients)

        def worker():
            nonlocal done
            with Client(net.url, ckey) as c:
                for _ in range(per_client):
                    one(c)
                    with lock:
                        done += 1

        threads = [threading.Thread(target=worker) for _ in range(args.clients)]
        pids = {"broker": net.broker.pid, "s3 server": s3.proc.pid if s3 else None,
                "this process": os.getpid()}
        cpu0 = {k: _cpu_s(p)[0] if p else 0.0 for k, p in pids.items()}
        io0 = io_bytes(net.broker.pid)
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        cpu1 = {k: _cpu_s(p)[0] if p else 0.0 for k, p in pids.items()}
        io_kib = (io_bytes(net.broker.pid) - io0) / 1024 / max(done, 1)
        cpu_ms = {k: (cpu1[k] - cpu0[k]) * 1000 / max(done, 1) for k in pids}
        local = [p for p in (net.data_dir / "blobs").rglob("*")
                 if p.is_file() and "registry" not in p.parts]
        return {"mode": mode, "jobs": done, "elapsed_s": elapsed, "jobs_per_s": done / elapsed,
                "cpu_ms": cpu_ms, "broker_blob_files": len(local), "io_kib": io_kib}
    finally:
        for a, _ in agents:
            a.stop()
        for _, t in agents:
            t.join(10)
        net.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=200, help="jobs per mode and round")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--agents", type=int, default=1)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--size-kib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=1, help="stream and s3 alternately, N times")
    ap.add_argument("--no-download", dest="download", action="store_false",
                    help="leave out the client's download of each output")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the in-process agents' per-job lines
    print(f"{args.size_kib} KiB outputs, {args.jobs} jobs per mode, {args.clients} clients, "
          f"{args.agents} agent(s) × {args.slots} slots, client download "
          f"{'on' if args.download else 'off'}; CPU ms per job", flush=True)
    print(f"{'mode':>7} {'jobs/s':>8} {'broker':>8} {'s3 server':>10} {'clients+agents':>15} "
          f"{'broker blob files':>18} {'broker I/O KiB/job':>19}")
    rows = []
    with S3Server(log_path=Path(tempfile.gettempdir()) / "sc-bench-s3.log") as s3:
        for _ in range(args.rounds):
            for mode in ("stream", "s3"):
                r = run_mode(mode, s3 if mode == "s3" else None, args)
                rows.append(r)
                c = r["cpu_ms"]
                print(f"{mode:>7} {r['jobs_per_s']:>8.1f} {c['broker']:>8.2f} "
                      f"{c['s3 server']:>10.2f} {c['this process']:>15.2f} "
                      f"{r['broker_blob_files']:>18} {r['io_kib']:>19.0f}", flush=True)
    by = {m: [r for r in rows if r["mode"] == m] for m in ("stream", "s3")}
    mean = lambda rs, f: sum(f(r) for r in rs) / len(rs)  # noqa: E731
    b_stream = mean(by["stream"], lambda r: r["cpu_ms"]["broker"])
    b_s3 = mean(by["s3"], lambda r: r["cpu_ms"]["broker"])
    j_stream = mean(by["stream"], lambda r: r["jobs_per_s"])
    j_s3 = mean(by["s3"], lambda r: r["jobs_per_s"])
    print(f"broker CPU per job: s3 ÷ stream = {b_s3 / max(b_stream, 1e-9):.2f} "
          f"({b_s3:.2f} vs {b_stream:.2f} ms); jobs/s: s3 ÷ stream = "
          f"{j_s3 / max(j_stream, 1e-9):.2f} ({j_s3:.1f} vs {j_stream:.1f}). All processes "
          "share this machine's cores: the S3 server's CPU is a stand-in for a real store's.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
