"""Connections benchmark (issue #22): one broker replica holds 10,000 agent streams and
2,000 waiting clients while a few real echo agents run real jobs.

One run, everything on loopback:
  1. a broker (`sparecycles broker serve`, SQLite) and --agents real echo agents
     (sdk.localnet, sandboxed when bwrap is there), with no idle load: the real jobs'
     added latency (one client, one job at a time, p50/p99 less the in-process echo call)
     and throughput (--clients clients in a closed loop), /livez p50/p99 (asked over and
     over while the throughput run goes on), the broker's RSS and threads;
  2. the load generator, a process of its own (this script with --generator, grpc.aio and
     raw asyncio HTTP): --holders agent streams serve echo pinned to a weights digest
     nobody else has and take the waiting jobs (echo, sleep_ms=60000, pinned to that
     digest, so only they run them): they report each as running and renew its lease in
     their heartbeats, and finish none while the bench runs. --waiters clients wait on
     those running jobs, half with long polls (GET /v1/jobs/<id>?wait=60, again after
     each answer) and half with server-sent event streams. Then the rest of --streams
     agent streams connect, serving sd15 (no job in this bench asks for it): every stream
     does the real handshake (hello, the challenge signed with its own Ed25519 key,
     capabilities) and heartbeats at the interval the broker's welcome gives;
  3. with all of that held, the same figures as in 1, and the heartbeats the broker
     handled per second (its /metrics) over the measurement.
Targets: broker RSS <= 2 GiB, /livez p99 <= 50 ms, the real jobs' added p50 at most 2x the
unloaded figure.

    python bench/connections.py [--streams 10000] [--waiters 2000] [--agents 2]
                                [--jobs 400] [--clients 8] [--lease-timeout 30]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DIGEST = "ab" * 32  # the weights digest only the holders advertise
HOLDER_SLOTS = 64


def raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


# ---- the load generator (its own process) -----------------------------------------------
class Generator:
    def __init__(self, args):
        self.args = args
        self.welcomed = 0
        self.refused: dict[str, int] = {}
        self.heartbeats = 0
        self.held_jobs: list[str] = []
        self.waiting = 0
        self.answers = 0
        self.http_errors: dict[str, int] = {}
        self.stop = asyncio.Event()

    async def agent(self, pb, pb_grpc, grpc, KeyPair, challenge_document, *, holder: bool,
                    sem: asyncio.Semaphore, started: asyncio.Event | None = None):
        key = KeyPair.generate()
        channel = grpc.aio.insecure_channel(self.args.grpc, options=[
            ("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_permit_without_calls", 1)])
        try:
            async with sem:
                call = pb_grpc.AgentGatewayStub(channel).Connect(
                    metadata=[("authorization", f"Bearer {self.args.provider_key}")])
                await call.write(pb.AgentMessage(hello=pb.Hello(
                    public_key=key.public_key_hex, name="holder" if holder else "idle")))
                ch = (await call.read()).challenge
                doc = challenge_document(ch.nonce, key.public_key_hex, ch.broker_public_key)
                await call.write(pb.AgentMessage(challenge_response=pb.ChallengeResponse(
                    signature=key.sign("challenge", doc))))
                plugin = (pb.PluginCapability(name="echo", version="1.0.0",
                                              weights_digest=DIGEST) if holder else
                          pb.PluginCapability(name="sd15", version="1.0.0"))
                await call.write(pb.AgentMessage(capabilities=pb.Capabilities(
                    plugins=[plugin], slots=HOLDER_SLOTS if holder else 1, sandboxed=True,
                    hardware=pb.Hardware(device="cpu", cpu_count=2, memory_gb=8.0))))
                welcome = (await call.read()).welcome
            self.welcomed += 1
            if started is not None:
                started.set()
            running: list[str] = []

            async def beat():
                interval = max(0.2, welcome.heartbeat_interval_s)
                await asyncio.sleep(random.random() * interval)  # spread them out
                while not self.stop.is_set():
                    await call.write(pb.AgentMessage(heartbeat=pb.Heartbeat(
                        running_job_ids=running)))
                    self.heartbeats += 1
                    await asyncio.sleep(interval)

            beats = asyncio.ensure_future(beat())
            try:
                while True:
                    msg = await call.read()
                    if msg is grpc.aio.EOF:
                        return
                    if msg.WhichOneof("body") == "assignment":
                        env = json.loads(msg.assignment.envelope)
                        running.append(env["job_id"])
                        self.held_jobs.append(env["job_id"])
                        await call.write(pb.AgentMessage(accepted=pb.JobAccepted(
                            job_id=env["job_id"], attempt=env["attempt"])))
            finally:
                beats.cancel()
        except grpc.aio.AioRpcError as exc:
            if not self.stop.is_set():
                name = exc.code().name
                self.refused[name] = self.refused.get(name, 0) + 1
        except asyncio.CancelledError:
            pass
        finally:
            await channel.close()

    async def http(self, method: str, path: str, body: bytes = b"", key: str = ""):
        """One request on a fresh connection; (status, body)."""
        host, port = self.args.url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write((f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: "
                          f"Bearer {key}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                          ).encode() + body)
            data = await reader.read()
        finally:
            writer.close()
        head, _, payload = data.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), payload

    async def long_poll(self, job_id: str, ready: asyncio.Event) -> None:
        """GET ?wait=60 on one keep-alive connection, again after each answer."""
        await asyncio.sleep(random.random() * 5)  # clients do not all start at once
        host, port = self.args.url.removeprefix("http://").rsplit(":", 1)
        req = (f"GET /v1/jobs/{job_id}?wait=60 HTTP/1.1\r\nHost: {host}\r\nAuthorization: "
               f"Bearer {self.args.client_key}\r\n\r\n").encode()
        while not self.stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(host, int(port))
                try:
                    while not self.stop.is_set():
                        writer.write(req)
                        self.waiting += 1
                        ready.set()
                        try:
                            head = await reader.readuntil(b"\r\n\r\n")
                        finally:
                            self.waiting -= 1
                        length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                                          if line.lower().startswith(b"content-length")))
                        body = await reader.readexactly(length)
                        self.answers += 1
                        if b'"state":"running"' not in body and head.startswith(b"HTTP/1.1 200"):
                            self.error("the job is no longer running")
                            return
                        elif not head.startswith(b"HTTP/1.1 200"):
                            self.error(head.split(b"\r\n", 1)[0].decode())
                            await asyncio.sleep(1)
                finally:
                    writer.close()
            except (OSError, asyncio.IncompleteReadError) as exc:
                self.error(type(exc).__name__)
                await asyncio.sleep(1)

    async def events(self, job_id: str, ready: asyncio.Event) -> None:
        """An event stream, reopened if the broker ends it."""
        await asyncio.sleep(random.random() * 5)
        host, port = self.args.url.removeprefix("http://").rsplit(":", 1)
        req = (f"GET /v1/jobs/{job_id}/events HTTP/1.1\r\nHost: {host}\r\nAuthorization: "
               f"Bearer {self.args.client_key}\r\nAccept: text/event-stream\r\n\r\n").encode()
        while not self.stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(host, int(port))
                try:
                    writer.write(req)
                    self.waiting += 1
                    ready.set()
                    while not self.stop.is_set() and await reader.read(65536):
                        pass
                finally:
                    self.waiting -= 1
                    writer.close()
            except OSError as exc:
                self.error(type(exc).__name__)
                await asyncio.sleep(1)

    def error(self, what: str) -> None:
        self.http_errors[what] = self.http_errors.get(what, 0) + 1

    async def run(self) -> None:
        import grpc

        from sdk.protocol import agent_pb2 as pb
        from sdk.protocol import agent_pb2_grpc as pb_grpc
        from sdk.protocol.envelope import challenge_document
        from sdk.protocol.signing import KeyPair

        a = self.args
        tools = (pb, pb_grpc, grpc, KeyPair, challenge_document)
        sem = asyncio.Semaphore(a.connect_concurrency)
        tasks = []
        holders = max(1, -(-a.waiters // HOLDER_SLOTS)) if a.waiters else 0
        t0 = time.monotonic()
        for _ in range(holders):
            tasks.append(asyncio.ensure_future(self.agent(*tools, holder=True, sem=sem)))
        while self.welcomed < holders:
            await asyncio.sleep(0.05)
        # The waiting jobs, pinned to the holders' digest: they run on the holders alone.
        body = json.dumps({"plugin": "echo", "inputs": {"text": "hold", "sleep_ms": 60000},
                           "weights_digest": DIGEST}).encode()
        jobs = []
        for i in range(0, a.waiters, 100):
            batch = await asyncio.gather(*(self.http("POST", "/v1/jobs", body, a.client_key)
                                           for _ in range(min(100, a.waiters - i))))
            for status, payload in batch:
                if status not in (200, 202):
                    raise SystemExit(f"submitting a waiting job failed: {status} {payload!r}")
                jobs.append(json.loads(payload)["id"])
        while len(self.held_jobs) < len(jobs):
            await asyncio.sleep(0.05)
        self.report("holders", holders=holders, jobs=len(jobs),
                    seconds=round(time.monotonic() - t0, 1))
        readies = []
        for i, job_id in enumerate(jobs):
            ready = asyncio.Event()
            readies.append(ready)
            waiter = self.long_poll if i % 2 == 0 else self.events
            tasks.append(asyncio.ensure_future(waiter(job_id, ready)))
        for r in readies:
            await r.wait()
        t1 = time.monotonic()
        for _ in range(a.streams - holders):
            tasks.append(asyncio.ensure_future(self.agent(*tools, holder=False, sem=sem)))
        while self.welcomed + sum(self.refused.values()) < a.streams:
            await asyncio.sleep(0.1)
        self.report("ready", streams=self.welcomed, refused=self.refused,
                    waiting=self.waiting, connect_s=round(time.monotonic() - t1, 1))
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until EOF
        self.stop.set()
        self.report("done", heartbeats_sent=self.heartbeats, answers=self.answers,
                    http_errors=self.http_errors, refused=self.refused)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    def report(event: str, **fields) -> None:
        print(json.dumps({"event": event, **fields}), flush=True)


def generator_main(args) -> int:
    raise_nofile()
    import uvloop

    uvloop.install()
    asyncio.run(Generator(args).run())
    return 0


# ---- the measuring side -----------------------------------------------------------------
def broker_status(pid: int) -> dict:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        fields[k] = v.strip()
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "threads": int(fields["Threads"])}


def cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a live process (0 when there is none)."""
    if pid is None:
        return 0.0
    try:
        parts = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy so far (every process on the machine)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def metric(url: str, name: str) -> float:
    import urllib3

    text = urllib3.request("GET", f"{url}/metrics", timeout=10).data.decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


class LivezProbe:
    """Asks /livez every 10 ms on one keep-alive connection, in a thread of its own."""

    def __init__(self, url: str):
        import urllib3

        self.pool = urllib3.HTTPConnectionPool("127.0.0.1", int(url.rsplit(":", 1)[1]),
                                               maxsize=1, retries=False, timeout=30)
        self.ms: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            self.pool.request("GET", "/livez")
            self.ms.append((time.perf_counter() - t) * 1000)
            time.sleep(0.01)

    def close(self) -> dict:
        self.stop.set()
        self.thread.join()
        return {"livez_p50": statistics.median(self.ms), "livez_p99": pct(self.ms, 99),
                "livez_n": len(self.ms)}


def measure_held(net, seconds: float, generator: int | None) -> dict:
    """The load alone, with no job running: what holding it costs the broker."""
    pid = net.broker.pid
    hb0, t0 = metric(net.url, "sparecycles_agent_heartbeats_total"), time.perf_counter()
    cpu0 = (cpu_s(pid), cpu_s(generator), machine_busy_s())
    probe = LivezProbe(net.url)
    time.sleep(seconds)
    livez = probe.close()
    elapsed = time.perf_counter() - t0
    hb1 = metric(net.url, "sparecycles_agent_heartbeats_total")
    cpu1 = (cpu_s(pid), cpu_s(generator), machine_busy_s())
    return {**livez, "heartbeats_per_s": (hb1 - hb0) / elapsed,
            "broker_cores": (cpu1[0] - cpu0[0]) / elapsed,
            "generator_cores": (cpu1[1] - cpu0[1]) / elapsed,
            "machine_cores": (cpu1[2] - cpu0[2]) / elapsed, **broker_status(pid)}


def measure(net, ckey: str, args, direct_p50: float, generator: int | None = None) -> dict:
    from sdk import Client

    pid = net.broker.pid
    probe = LivezProbe(net.url)  # /livez while the jobs below run
    with Client(net.url, ckey) as client:
        for _ in range(10):
            client.generate("echo", text="warm")
        lat = []
        for _ in range(args.latency_jobs):
            t = time.perf_counter()
            client.generate("echo", text="x")
            lat.append((time.perf_counter() - t) * 1000)

    done = 0
    lock = threading.Lock()
    per_client = max(1, args.jobs // args.clients)

    def worker():
        nonlocal done
        with Client(net.url, ckey) as c:
            for _ in range(per_client):
                c.generate("echo", text="y")
                with lock:
                    done += 1

    hb0, t0 = metric(net.url, "sparecycles_agent_heartbeats_total"), time.perf_counter()
    cpu0 = (cpu_s(pid), cpu_s(generator), machine_busy_s())
    workers = [threading.Thread(target=worker) for _ in range(args.clients)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0
    hb1 = metric(net.url, "sparecycles_agent_heartbeats_total")
    cpu1 = (cpu_s(pid), cpu_s(generator), machine_busy_s())
    livez = probe.close()
    p50 = statistics.median(lat)
    return {"p50": p50, "p99": pct(lat, 99), "added_p50": p50 - direct_p50,
            "added_p99": pct(lat, 99) - direct_p50, "jobs_per_s": done / elapsed,
            **livez, "heartbeats_per_s": (hb1 - hb0) / elapsed,
            "broker_cores": (cpu1[0] - cpu0[0]) / elapsed,
            "generator_cores": (cpu1[1] - cpu0[1]) / elapsed,
            "machine_cores": (cpu1[2] - cpu0[2]) / elapsed, **broker_status(pid),
            "waiting": metric(net.url, "sparecycles_http_waiting_clients"),
            "streams": metric(net.url, "sparecycles_agent_streams")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=10_000, help="agent streams of the load")
    ap.add_argument("--waiters", type=int, default=2000, help="waiting clients of the load")
    ap.add_argument("--agents", type=int, default=2, help="real echo agents")
    ap.add_argument("--slots", type=int, default=4, help="slots per real agent")
    ap.add_argument("--jobs", type=int, default=400, help="jobs of each throughput run")
    ap.add_argument("--clients", type=int, default=8, help="clients of each throughput run")
    ap.add_argument("--latency-jobs", type=int, default=300)
    ap.add_argument("--lease-timeout", type=float, default=30.0,
                    help="the broker's lease timeout (heartbeats come every third of it)")
    ap.add_argument("--connect-concurrency", type=int, default=200,
                    help="handshakes the generator runs at once")
    ap.add_argument("--no-sandbox", action="store_true")
    ap.add_argument("--held-s", type=float, default=15.0,
                    help="seconds measured with the load held and no job running")
    ap.add_argument("--hold-s", type=float, default=0.0,
                    help="hold the load this long before measuring (e.g. to profile)")
    ap.add_argument("--generator", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--grpc", help=argparse.SUPPRESS)
    ap.add_argument("--provider-key", help=argparse.SUPPRESS)
    ap.add_argument("--client-key", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generator:
        return generator_main(args)

    import urllib3

    from bench.dispatch import direct_call_ms
    from sdk.localnet import LocalNetwork

    raise_nofile()
    direct = statistics.median(direct_call_ms(500))
    sandbox = not args.no_sandbox and shutil.which("bwrap") is not None
    work = Path(tempfile.mkdtemp(prefix="sc-conn-"))
    # The waiting jobs' holders never finish them: the stall watch must not take them back
    # while the bench runs (their bound would be 1.5 x 120 s + the lease otherwise).
    net = LocalNetwork(work, lease_timeout_s=args.lease_timeout,
                       env={"SPARECYCLES_VERIFICATION": "off",
                            "SPARECYCLES_STALL_FACTOR": "1000"})
    gen = None
    try:
        net.start_broker()
        pkey = net.create_key("provider")
        ckey = net.create_key("client", credits="100000000")
        for i in range(args.agents):
            net.start_agent(f"a{i}", pkey, plugins="echo", slots=args.slots, sandbox=sandbox)
        net.wait_for_providers(args.agents)
        print(f"broker pid {net.broker.pid}; {args.agents} real echo agents "
              f"(sandbox {'on' if sandbox else 'off'}, {args.slots} slots); direct echo call "
              f"p50 {direct:.3f} ms", flush=True)
        unloaded = measure(net, ckey, args, direct)
        print("unloaded: " + json.dumps({k: round(v, 2) for k, v in unloaded.items()}),
              flush=True)

        gkey = net.create_key("provider", "load")
        gen = subprocess.Popen(
            [sys.executable, __file__, "--generator", "--url", net.url, "--grpc",
             net.info["grpc"], "--provider-key", gkey, "--client-key", ckey,
             "--streams", str(args.streams), "--waiters", str(args.waiters),
             "--connect-concurrency", str(args.connect_concurrency)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        while True:
            line = gen.stdout.readline()
            if not line:
                raise SystemExit(f"the load generator exited ({gen.wait()})")
            event = json.loads(line)
            print(f"load generator: {line.strip()} (+{time.monotonic() - t0:.0f} s)",
                  flush=True)
            if event["event"] == "ready":
                break
        time.sleep(2 + args.hold_s)  # the last connections settle
        held = measure_held(net, args.held_s, gen.pid)
        print("held:     " + json.dumps({k: round(v, 2) for k, v in held.items()}), flush=True)
        loaded = measure(net, ckey, args, direct, generator=gen.pid)
        print("loaded:   " + json.dumps({k: round(v, 2) for k, v in loaded.items()}),
              flush=True)
        gen.stdin.close()
        print("load generator: " + gen.stdout.readline().strip(), flush=True)
        gen.wait(60)

        rows = [("broker RSS (MiB)", "rss_mb", ".0f"), ("broker threads", "threads", ".0f"),
                ("agent streams", "streams", ".0f"), ("waiting clients", "waiting", ".0f"),
                ("/livez p50 (ms)", "livez_p50", ".2f"), ("/livez p99 (ms)", "livez_p99", ".2f"),
                ("heartbeats handled/s", "heartbeats_per_s", ".0f"),
                ("real jobs/s", "jobs_per_s", ".0f"),
                ("real jobs added p50 (ms)", "added_p50", ".2f"),
                ("real jobs added p99 (ms)", "added_p99", ".2f"),
                ("broker CPU (cores)", "broker_cores", ".2f"),
                ("load generator CPU (cores)", "generator_cores", ".2f"),
                (f"machine CPU (of {os.cpu_count()} cores)", "machine_cores", ".2f")]
        print(f"\n{'':30} {'no idle load':>13} {'load, no jobs':>14} {'load + jobs':>12}")
        for label, key, fmt in rows:
            mid = format(held[key], fmt) if key in held else "-"
            print(f"{label:30} {unloaded[key]:>13{fmt}} {mid:>14} {loaded[key]:>12{fmt}}")
        refused = [line for line in urllib3.request("GET", f"{net.url}/metrics").data
                   .decode().splitlines() if "refused" in line and not line.startswith("#")]
        print("refusals: " + "; ".join(refused))
        ratio = loaded["added_p50"] / max(unloaded["added_p50"], 1e-6)
        print(f"\ntargets: RSS <= 2048 MiB: {loaded['rss_mb']:.0f}; /livez p99 <= 50 ms: "
              f"{loaded['livez_p99']:.1f}; added p50 <= 2x unloaded: {ratio:.2f}x")
        log = (work / "broker.log").read_text(errors="replace").splitlines()
        errors = [line for line in log if " ERROR " in line or " WARNING " in line]
        print(f"broker log: {len(errors)} warnings and errors"
              + "".join(f"\n  {line[:300]}" for line in errors[:5]))
    finally:
        if gen is not None and gen.poll() is None:
            gen.kill()
            gen.wait()
        net.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
