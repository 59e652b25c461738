"""Dispatch benchmark: jobs/s and added latency of the broker path with the echo plugin.

Starts a real broker (SQLite, as `make demo` does, PostgreSQL with --db, or both, one after
the other) and 1, 2 and 4
real agents on loopback, then measures
  * added latency: one client, one job at a time, submit → settled (p50/p99), minus the
    direct in-process plugin call measured in the same run;
  * throughput: many clients in parallel (closed loop), completed jobs per second.
Prints a table and the ratio against the direct call. Beside each row it runs the raw
durable queue of bench/raw_queue.py (insert, claim, mark done, tell the client; nothing
else) with the same clients, workers and database, and prints our jobs/s over its jobs/s:
the machine-independent yardstick (issue #28 targets >= 0.5x; --no-raw skips it). It also
prints the broker's statements and COMMITs per job during the throughput run (the broker
counts them with SPARECYCLES_COUNT_STATEMENTS=1, broker/storage/counting.py; "n/a" from a
broker that does not), the receipts settled per settlement transaction (issue #28's
receipt batches; 1 without them) and the assignments per message sent to agents (its
assignment batches: what one dispatcher pass places on an agent goes in one message).
Targets (issue #2, 2-core machine): >= 300 jobs/s and <= 15 ms p50 added latency.

Measured here (2 cores, 1/2/4 agents, 600 jobs) on 2026-11-30, side by side with the code
from the start of that day's second session (two rounds, run alternately): 177–198 jobs/s
against 144–156, the broker's CPU per job 4.6–5.1 ms against 6.1–6.6 ms, agents about
1 ms, and 4.6–4.9 ms added p50 (before: 5.5–6.2 ms); a later session's runs, on the same
code and after: 188–228 jobs/s, 3.9–5.5 ms added p50, the broker 4.0–4.8 ms per job (a
spread of ±10 % between runs of the same code). Machines differ from day to day and
hour to hour (the same code did 45 jobs/s on a slow one), so compare runs made together.
The broker is one GIL-bound Python process, so its CPU per job caps the rate however many
cores there are (docs/architecture.md, "Dispatch throughput", says where it goes).

    python bench/dispatch.py [--agents 1,2,4] [--jobs 300] [--clients 32] [--slots 4]
                             [--split N] [--per-request K]
                             [--tls] [--metrics on|off|on,off] [--svg out/bench-dispatch.svg]
                             [--db sqlite,postgresql+psycopg://postgres@127.0.0.1:5432/postgres]

--split N sends split requests of N sibling jobs (``generate(..., n=N)``); --per-request K
sends K independent job requests in one ``POST /v1/jobs/bulk`` (``generate_many``). On
2026-12-03 (2 shared cores, 1 agent, 200 jobs, no sandbox, two rounds alternating): one job
per request 78–99 jobs/s (the broker 9.2–11.2 ms of CPU per job), --per-request 8 130–134
(6.5–6.9 ms; 115–121 with 4 clients, as many jobs in flight as 32 single ones), --split 8
115–129 (7.2–8.1 ms).
On 2026-12-04 (a quiet machine, 8 slots, 32 clients, 300 jobs, one job per request, no
sandbox, one run each): SQLite 198–211 jobs/s, 5.7–5.9 ms added p50, the broker 4.4–4.6 ms
of CPU per job, 33–38 statements and 0.8–1.1 commits per job, 1.4–2.0 assignments per
message, the raw queue 2,157–2,689 jobs/s (0.07–0.09x); PostgreSQL 86–93 jobs/s, 10.9–11.5
ms added p50, the broker 8.4–9.4 ms and the database 4.1–5.2 ms per job, 21–26 statements
and 2.3–2.6 commits per job, 1.0 assignments per message, the raw queue 970–1,142 jobs/s
(0.08–0.09x). Later that day, `make bench` (both databases, sandbox on, 600 jobs, 1/2/4
agents), two runs an hour apart on a machine that slowed by about half between them:
SQLite 184–187 then 108–139 jobs/s against the raw queue's 2,155–2,385 then 1,582–2,250
(0.08–0.09x, then 0.06–0.07x), 6.0–7.3 then 10.4–11.3 ms added p50; PostgreSQL 56–84 then
51–61 jobs/s against 893–1,077 then 749–961 (0.08x, then 0.06–0.07x; the first run's
4-worker raw queue stranded a client, since fixed), 14.4–15.6 then 20.0–23.6 ms added p50,
20–24 statements and 2.4–2.7 commits per job.

With --tls each agent count runs twice, plaintext and then TLS on both hops (clients to
the REST API, agents to the gateway; a dev CA from `broker dev-cert`), in the same run, and
the cost of TLS is printed: the ratio of jobs/s and the added p50 latency. Job inputs are
sealed to the provider in both (sealing is always on).

With --db naming a PostgreSQL server, each run gets a fresh database there (dropped after);
--db sqlite,postgresql+psycopg://… runs the whole table on each, one after the other (make
bench does, when a PostgreSQL server answers at BENCH_PG, 127.0.0.1:5432 by default).

--metrics on,off runs each agent count with the broker's metrics on (every request and job
event counted, /metrics scraped every second during the throughput run: harsher than a
Prometheus at its usual 15 s) and off (SPARECYCLES_METRICS=off), alternately, and prints
what metrics cost in jobs/s (issue #25: target at most 3 %).

    python bench/dispatch.py --replicas 3 --db postgresql+psycopg://postgres@127.0.0.1:5432/postgres
                             [--agents 2] [--jobs 300] [--clients 12] [--slots 8]

runs 1, 2 and 3 broker replicas on that server (issue #21): agents on the first replica,
clients spread over all, and prints jobs/s and the added p50/p99 of jobs submitted on the
agents' replica beside those submitted on another (their placement and their end cross
replicas through LISTEN/NOTIFY), measured in the same run. Before the table it probes
what sealing the wake-ups costs: one at a time between two buses on that server, plain
and sealed with an at-rest key, alternating (the replicas always seal theirs).

The brokers and agents run as `python -P -m sdk.cli`: the code the venv's editable install
points at (/work/main here), not this file's checkout. To measure a worktree, run with
PYTHONPATH set to it.

With --svg it also draws the figures, a band per database: jobs/s with the raw queue's
beside each row and the target, and where each job's CPU went against the budget the
target leaves on this machine's cores.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdk import Client  # noqa: E402
from sdk.localnet import LocalNetwork  # noqa: E402


def direct_call_ms(n: int = 2000) -> list[float]:
    """The echo plugin called in-process: the floor any network path is compared with."""
    from plugins import builtin_plugin_dir
    from plugins.api import load_manifest
    sys.path.insert(0, str(builtin_plugin_dir("echo")))
    from plugin import Echo  # type: ignore

    class Ctx:
        job_id = "bench"
        scratch_dir = Path(tempfile.gettempdir())

        def progress(self, *a): pass
        def stream(self, *a): pass
        def cancelled(self): return False
        def check_cancelled(self): pass

    manifest = load_manifest(builtin_plugin_dir("echo"))
    plugin = Echo()
    plugin.setup(None, "cpu")
    out = []
    for _ in range(n):
        t = time.perf_counter()
        plugin.run(manifest.validate_inputs({"text": "x"}), Ctx())
        out.append((time.perf_counter() - t) * 1000)
    return out


def _spread(values: list[float]) -> float:
    """(max - min) / mean, in per cent: how far runs of the same code differ."""
    return (max(values) - min(values)) / statistics.mean(values) * 100 if values else 0.0


def metrics_us_per_job(n: int = 20_000) -> float:
    """What the broker's metrics add to one job, in microseconds, timed in-process: the
    calls one echo job makes (two HTTP answers, submitted, placed, ended, settled, an
    output's bytes, a hold and a post through the metered ledger)."""
    from types import SimpleNamespace

    from broker.observability.metered import MeteredBlobStore, MeteredLedger
    from broker.observability.metrics import BrokerMetrics

    m = BrokerMetrics(replica="bench")
    txn = SimpleNamespace(kind=SimpleNamespace(value="post"), entries=(
        SimpleNamespace(account=SimpleNamespace(kind=SimpleNamespace(value="provider_vesting")),
                        amount_micro=900),
        SimpleNamespace(account=SimpleNamespace(kind=SimpleNamespace(value="client_held")),
                        amount_micro=-900)))
    ledger = MeteredLedger(SimpleNamespace(post=lambda *a, **k: txn, hold=lambda *a, **k: 1), m)
    blobs = MeteredBlobStore(SimpleNamespace(put=lambda data: "k"), m, "jobs")
    data = b"x" * 64
    t = time.perf_counter()
    for _ in range(n):
        m.http_request("/v1/jobs", "POST", 202, 0.002)
        m.http_request("/v1/jobs/<job_id>", "GET", 200, 0.004)
        m.submitted("echo")
        ledger.hold("h", 1)
        m.placed("echo", 0.001)
        blobs.put(data)
        ledger.post("h", None)
        m.settled("echo", 0.001)
        m.ended("echo", "settled", 0.01)
    return (time.perf_counter() - t) / n * 1e6


def _cpu_s(pid: int) -> tuple[float, float]:
    """(own, reaped children's) user + system CPU seconds of one live process (Linux
    /proc); zeros when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        tick = os.sysconf("SC_CLK_TCK")
        return ((int(fields[11]) + int(fields[12])) / tick,
                (int(fields[13]) + int(fields[14])) / tick)
    except (OSError, IndexError, ValueError):
        return 0.0, 0.0


def _children() -> dict[int, list[int]]:
    """Every live process's children, from one pass over /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return children


def _tree(pid: int, children: dict[int, list[int]]) -> list[int]:
    """``pid`` and its live descendants (an agent's sandboxed plugin hosts)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _postgres_cpu_s() -> float:
    """CPU seconds of the PostgreSQL server's processes on this machine, live ones and
    those that exited (its backends serve the broker's connections, and one exits with
    each connection the pool closes; with SQLite the database runs inside the broker)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if "(postgres)" in stat.read_text():
                total += sum(_cpu_s(int(stat.parent.name)))
        except (OSError, ValueError):
            continue
    return total


def cpu_split(net, client_pid: int) -> dict[str, float]:
    """CPU seconds used so far by the broker, the agents, their plugin hosts (live ones,
    and those that exited and were reaped), this process (the clients) and, when the
    broker runs on PostgreSQL, the database server: where the machine's cores go."""
    children = _children()
    agents = hosts = 0.0
    for a in net.agents:
        for i, pid in enumerate(_tree(a.proc.pid, children)):
            own, reaped = _cpu_s(pid)
            if i == 0:
                agents += own
            else:
                hosts += own
            hosts += reaped
    brokers = [net.broker.pid] + [proc.pid for proc, _ in getattr(net, "replicas", [])]
    split = {"broker": sum(_cpu_s(pid)[0] for pid in brokers), "agents": agents,
             "hosts": hosts,
             "clients": _cpu_s(client_pid)[0]}
    if (net.db_url or "").startswith("postgresql"):
        split["database"] = _postgres_cpu_s()
    return split


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


@contextmanager
def fresh_database(url: str | None):
    """``url`` for SQLite (None: the broker's own file); for a PostgreSQL server, the URL of
    a new database on it, dropped afterwards."""
    if not url or not url.startswith("postgresql"):
        yield url
        return
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"sparecycles_bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
        yield make_url(url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def db_counts(net) -> dict[str, float] | None:
    """The broker's statement and COMMIT counts so far, from /metrics
    (SPARECYCLES_COUNT_STATEMENTS, broker/storage/counting.py); None from a broker that
    does not count them (older code) or serves no metrics."""
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(f"{net.url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except (OSError, urllib.error.URLError):
        return None
    got = {}
    for line in text.splitlines():
        for key, name in (("statements", "sparecycles_db_statements_total"),
                          ("commits", "sparecycles_db_commits_total"),
                          ("receipts", "sparecycles_agent_receipts_total"),
                          ("settlements", "sparecycles_agent_receipt_settlements_total"),
                          ("assignments", "sparecycles_agent_assignments_total"),
                          ("assignment_messages",
                           "sparecycles_agent_assignment_messages_total")):
            if line.startswith(name + " "):
                got[key] = float(line.split()[1])
    if "statements" not in got or "commits" not in got:
        return None
    got.setdefault("receipts", 0.0)  # a broker from before receipt batches (issue #28)
    got.setdefault("settlements", 0.0)
    got.setdefault("assignments", 0.0)  # and before assignment batches
    got.setdefault("assignment_messages", 0.0)
    return got


def run_one(n_agents: int, jobs: int, clients: int, slots: int, sandbox: bool,
             db_url: str | None = None, split: int = 1, tls: bool = False,
             metrics: bool = True, per_request: int = 1) -> dict:
    work = Path(tempfile.mkdtemp(prefix="sc-bench-"))
    # The dispatch path alone: verification (re-running sampled jobs) is measured by
    # bench/cheaters.py; rate limits (per key: every client here shares one) are off.
    net = LocalNetwork(work, db_url=db_url, env={"SPARECYCLES_VERIFICATION": "off",
                                                  "SPARECYCLES_RATE_LIMITS": "off",
                                                  "SPARECYCLES_METRICS": "on" if metrics
                                                  else "off",
                                                  "SPARECYCLES_COUNT_STATEMENTS": "1"}, tls=tls)
    try:
        net.start_broker()
        pkey = net.create_key("provider")
        ckey = net.create_key("client")
        for i in range(n_agents):
            net.start_agent(f"a{i}", pkey, plugins="echo", slots=slots, sandbox=sandbox)
        net.wait_for_providers(n_agents)
        client = net.client(ckey)
        for _ in range(20):  # warm-up: connections, caches, first-call paths
            client.generate("echo", text="warm")
        lat = []
        for _ in range(min(jobs, 200)):
            t = time.perf_counter()
            client.generate("echo", text="x")
            lat.append((time.perf_counter() - t) * 1000)
        client.close()

        done = 0
        lock = threading.Lock()
        per_call = split * per_request  # jobs per client request
        per_client = max(1, jobs // (clients * per_call))  # requests per client
        many = [{"plugin": "echo", "inputs": {"text": "y"}, **({"n": split} if split > 1
                                                               else {})}] * per_request

        def worker():
            nonlocal done
            with net.client(ckey) as c:
                for _ in range(per_client):
                    if per_request > 1:  # one POST /v1/jobs/bulk of independent jobs
                        c.generate_many(many)
                    else:
                        c.generate("echo", text="y", n=split)
                    with lock:
                        done += per_call

        threads = [threading.Thread(target=worker) for _ in range(clients)]
        scraped = threading.Event()
        scrapes = []

        def scrape():  # as a (very eager) Prometheus would
            import urllib.request
            while not scraped.wait(1.0):
                t = time.perf_counter()
                with urllib.request.urlopen(f"{net.url}/metrics", timeout=10) as resp:
                    resp.read()
                scrapes.append((time.perf_counter() - t) * 1000)
        scraper = threading.Thread(target=scrape, daemon=True) if metrics else None
        db0 = db_counts(net) if metrics else None
        cpu0 = cpu_split(net, os.getpid())
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        if scraper is not None:
            scraper.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        scraped.set()
        cpu1 = cpu_split(net, os.getpid())
        cpu_ms = {k: (cpu1[k] - cpu0[k]) * 1000 / max(done, 1) for k in cpu0}
        db1 = db_counts(net) if db0 is not None else None
        per_job = ({k: (db1[k] - db0[k]) / max(done, 1) for k in db0}
                   if db0 is not None and db1 is not None else None)
        if per_job is not None:  # receipts per settlement call (1: no batching)
            per_job["batch"] = (per_job["receipts"] / per_job["settlements"]
                                if per_job["settlements"] else 1.0)
            # and assignments per message to an agent (1: one envelope a message)
            per_job["assign_batch"] = (per_job["assignments"] / per_job["assignment_messages"]
                                       if per_job["assignment_messages"] else 1.0)
        return {"agents": n_agents, "tls": tls, "lat": lat, "jobs_per_s": done / elapsed,
                "done": done, "cpu_ms": cpu_ms, "metrics": metrics, "scrapes_ms": scrapes,
                "db_per_job": per_job}
    finally:
        net.stop()
        shutil.rmtree(work, ignore_errors=True)


def run_replicas(n_replicas: int, n_agents: int, jobs: int, clients: int, slots: int,
                 sandbox: bool, db_url: str) -> dict:
    """``n_replicas`` broker processes on one PostgreSQL database. The agents connect to
    the first replica; the clients are spread evenly over all of them, so (n - 1)/n of
    the throughput run's jobs are placed across replicas (submitted on one, run by an agent
    whose stream another holds, its end heard back through LISTEN/NOTIFY). Latency: one
    client at a time on the agents' replica (same-replica placement) and one on another
    (cross-replica), alternating, in the same run."""
    work = Path(tempfile.mkdtemp(prefix="sc-bench-replicas-"))
    net = LocalNetwork(work, db_url=db_url, env={"SPARECYCLES_VERIFICATION": "off"})
    try:
        net.start_broker()
        for _ in range(n_replicas - 1):
            net.start_replica()
        urls = [net.url] + [info["http"] for _, info in net.replicas]
        pkey = net.create_key("provider")
        ckey = net.create_key("client")
        for i in range(n_agents):
            net.start_agent(f"a{i}", pkey, plugins="echo", slots=slots, sandbox=sandbox)
        net.wait_for_providers(n_agents)
        same, cross = Client(urls[0], ckey), Client(urls[-1], ckey)
        for _ in range(20):
            same.generate("echo", text="warm")
            cross.generate("echo", text="warm")
        lat = {"same": [], "cross": []}
        for i in range(min(jobs, 200)):
            for kind, client in (("same", same), ("cross", cross)):
                if kind == "cross" and n_replicas == 1:
                    continue
                t = time.perf_counter()
                client.generate("echo", text="x")
                lat[kind].append((time.perf_counter() - t) * 1000)
        same.close()
        cross.close()

        done = 0
        lock = threading.Lock()
        per_client = max(1, jobs // clients)

        def worker(url):
            nonlocal done
            with Client(url, ckey) as c:
                for _ in range(per_client):
                    c.generate("echo", text="y")
                    with lock:
                        done += 1

        threads = [threading.Thread(target=worker, args=(urls[i % len(urls)],))
                   for i in range(clients)]
        cpu0 = cpu_split(net, os.getpid())
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        cpu1 = cpu_split(net, os.getpid())
        cpu_ms = {k: (cpu1[k] - cpu0[k]) * 1000 / max(done, 1) for k in cpu0}
        return {"replicas": n_replicas, "lat": lat, "jobs_per_s": done / elapsed,
                "done": done, "cpu_ms": cpu_ms,
                "cross_share": (n_replicas - 1) / n_replicas}
    finally:
        net.stop()
        shutil.rmtree(work, ignore_errors=True)


def notify_probe(db_url: str, n: int = 300) -> dict:
    """What sealing the wake-ups costs, in the same run: one wake-up at a time from one
    replica's bus (PgNotifyBus) to another's on ``db_url``, plain and sealed with an at-rest
    key (as replicas send them), alternating; the message is a job's end with its copy (the
    largest a waiting client's answer rides on). Returns the ms from publish to the other
    bus's handler per mode, and the CPU µs of packing, sealing and opening one payload."""
    import os as _os

    from broker.storage.notify_pg import PgNotifyBus
    from broker.storage.sealed import AtRestCipher

    cipher = AtRestCipher(_os.urandom(32))
    copy = {"id": str(uuid.uuid4()), "state": "settled", "plugin": "echo",
            "outputs": [{"text": "x" * 600}], "receipt": {"sig": "f" * 128, "units": 1.0},
            "inputs": {"text": "y" * 300}}
    message = {"j": copy["id"], "e": 1, "c": copy}
    pairs, got = {}, {}
    for mode, key in (("plain", None), ("sealed", cipher)):
        channel = f"bench_{mode}_{uuid.uuid4().hex[:8]}"
        sender = PgNotifyBus(db_url, replica_id=f"{mode}-a", channel=channel, cipher=key)
        receiver = PgNotifyBus(db_url, replica_id=f"{mode}-b", channel=channel, cipher=key)
        ev = threading.Event()
        receiver.subscribe("job", lambda data, ev=ev, mode=mode: (
            got.__setitem__(mode, time.perf_counter()), ev.set()))
        sender.start(), receiver.start()
        pairs[mode] = (sender, receiver, ev)
    lat = {"plain": [], "sealed": []}
    try:
        for i in range(n + 20):
            for mode in (("plain", "sealed") if i % 2 == 0 else ("sealed", "plain")):
                sender, _, ev = pairs[mode]
                ev.clear()
                t0 = time.perf_counter()
                sender.publish("job", message)
                if not ev.wait(5):
                    raise RuntimeError(f"a {mode} wake-up never arrived")
                if i >= 20:  # after a warm-up
                    lat[mode].append((got[mode] - t0) * 1000)
        sealed_sender, sealed_receiver, _ = pairs["sealed"]
        plain_sender = pairs["plain"][0]
        cpu = {}
        for mode, bus in (("plain", plain_sender), ("sealed", sealed_sender)):
            t = time.process_time()
            for _ in range(2000):
                payload = bus._pack([("job", message)])[0]
                doc = json.loads(payload)
                if mode == "sealed":
                    sealed_receiver._open(doc, payload)
            cpu[mode] = (time.process_time() - t) / 2000 * 1e6
        size = {mode: len(pairs[mode][0]._pack([("job", message)])[0]) for mode in pairs}
    finally:
        for sender, receiver, _ in pairs.values():
            sender.close(), receiver.close()
    return {"lat": lat, "cpu_us": cpu, "bytes": size}


def main_replicas(args, sandbox: bool, d50: float, d99: float) -> int:
    counts = ([int(x) for x in args.replicas.split(",")] if "," in args.replicas
              else list(range(1, int(args.replicas) + 1)))
    n_agents = int(args.agents.split(",")[0]) if args.agents != "1,2,4" else 2
    with fresh_database(args.db) as url:
        probe = notify_probe(url)
    p50 = {m: statistics.median(v) for m, v in probe["lat"].items()}
    p99 = {m: pct(v, 99) for m, v in probe["lat"].items()}
    print(f"a wake-up from one replica's bus to another's (a job's end with its copy, "
          f"{probe['bytes']['plain']} bytes plain, {probe['bytes']['sealed']} sealed; "
          f"{len(probe['lat']['plain'])} of each, alternating): plain p50 {p50['plain']:.3f} / "
          f"p99 {p99['plain']:.3f} ms, sealed p50 {p50['sealed']:.3f} / p99 {p99['sealed']:.3f} "
          f"ms: sealing adds {p50['sealed'] - p50['plain']:+.3f} ms p50 per crossing; CPU to "
          f"pack (and seal, and open) one: {probe['cpu_us']['plain']:.1f} µs plain, "
          f"{probe['cpu_us']['sealed']:.1f} µs sealed", flush=True)
    print(f"replicas on PostgreSQL, sandbox {'on' if sandbox else 'off'}, {n_agents} agent(s) "
          f"of {args.slots} slot(s) on the first replica, {args.clients} clients spread over "
          "the replicas")
    print(f"{'replicas':>8} {'jobs/s':>8} {'cross':>6} {'same p50':>9} {'same p99':>9} "
          f"{'cross p50':>10} {'cross p99':>10} {'Δp50':>7}   added ms over the direct call; "
          "CPU ms per job: brokers / agents / hosts / clients / database")
    for n in counts:
        with fresh_database(args.db) as url:
            r = run_replicas(n, n_agents, args.jobs, args.clients, args.slots, sandbox, url)
        s50, s99 = statistics.median(r["lat"]["same"]) - d50, pct(r["lat"]["same"], 99) - d99
        if r["lat"]["cross"]:
            c50 = statistics.median(r["lat"]["cross"]) - d50
            c99 = pct(r["lat"]["cross"], 99) - d99
            cross = f"{c50:>10.2f} {c99:>10.2f} {c50 - s50:>+7.2f}"
        else:
            cross = f"{'-':>10} {'-':>10} {'-':>7}"
        c = r["cpu_ms"]
        print(f"{n:>8} {r['jobs_per_s']:>8.0f} {r['cross_share']:>5.0%} {s50:>9.2f} "
              f"{s99:>9.2f} {cross}   {c['broker']:6.2f} / {c['agents']:5.2f} / "
              f"{c['hosts']:5.2f} / {c['clients']:5.2f} / {c.get('database', 0):5.2f}",
              flush=True)
    print("target: a job placed across replicas adds <= 5 ms p50 over one placed on its own "
          "replica (Δp50), measured in the same run. 'cross': the share of the throughput "
          "run's jobs submitted on a replica other than the agents'. The replicas' wake-ups "
          "are sealed (always: the at-rest key); a cross-replica job crosses twice (queued, "
          "then its end), so sealing's share of Δp50 is about twice the probe's above.")
    return 0


TARGET_JOBS_PER_S = 300
PARTS = [("broker", "#3b6ea5"), ("agents", "#e08a2e"), ("hosts", "#8cb369"),
         ("clients", "#9b7bb8"), ("database", "#7f8c8d")]


def _nice_step(raw: float) -> float:
    """1, 2 or 5 times a power of ten, at least ``raw``: round axis ticks."""
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def write_svg(bands: list[tuple[str, list[dict]]], path: Path, cores: int) -> None:
    """Two bar charts per database (``bands``: its name and rows), one band under another,
    in one SVG (no plotting library needed): jobs/s per number of agents with the raw
    queue's beside each and the target, and the CPU each job cost, by process, with the
    budget the target leaves on ``cores`` cores (cores × 1000 ms ÷ target jobs/s)."""
    budget = cores * 1000 / TARGET_JOBS_PER_S
    w, h, top, bottom, left = 360, 280, 64, 40, 50
    band_h = h + 30
    plot_h = h - top - bottom
    width = 2 * w + 40  # room for the legend's last entry
    height = band_h * len(bands)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    for i, (db, rows) in enumerate(bands):
        out.append(f'<g transform="translate(0 {i * band_h})">')
        _svg_band(out, rows, db, budget, cores, w, h, top, left, plot_h)
        out.append("</g>")
    out.append("</svg>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out) + "\n")


def _svg_band(out: list[str], rows: list[dict], db: str, budget: float, cores: int, w: int,
              h: int, top: int, left: int, plot_h: int) -> None:
    """One database's two panels (see ``write_svg``)."""

    def panel(x0: float, title: str, top_value: float, bars, line: float, line_label: str,
              fmt: str) -> None:
        step = _nice_step(top_value / 4)
        top_value = step * math.ceil(top_value / step)
        scale = plot_h / top_value
        out.append(f'<text x="{x0 + left}" y="20" font-weight="bold">{title}</text>')
        out.append(f'<line x1="{x0 + left}" y1="{top}" x2="{x0 + left}" y2="{top + plot_h}" '
                   'stroke="#444"/>')
        out.append(f'<line x1="{x0 + left}" y1="{top + plot_h}" x2="{x0 + w - 10}" '
                   f'y2="{top + plot_h}" stroke="#444"/>')
        for i in range(round(top_value / step) + 1):  # axis ticks
            v = step * i
            y = top + plot_h - v * scale
            out.append(f'<text x="{x0 + left - 6}" y="{y + 4:.1f}" text-anchor="end" '
                       f'fill="#444">{v:g}</text>')
        slot = (w - left - 20) / max(len(bars), 1)
        for i, (label, stack) in enumerate(bars):
            x, y = x0 + left + i * slot + slot * 0.2, top + plot_h
            for value, color in stack:
                out.append(f'<rect x="{x:.1f}" y="{y - value * scale:.1f}" '
                           f'width="{slot * 0.6:.1f}" height="{value * scale:.1f}" '
                           f'fill="{color}"/>')
                y -= value * scale
            total = sum(v for v, _ in stack)
            out.append(f'<text x="{x + slot * 0.3:.1f}" y="{y - 4:.1f}" '
                       f'text-anchor="middle">{total:{fmt}}</text>')
            out.append(f'<text x="{x + slot * 0.3:.1f}" y="{top + plot_h + 16}" '
                       f'text-anchor="middle">{label}</text>')
        y = top + plot_h - line * scale
        out.append(f'<line x1="{x0 + left}" y1="{y:.1f}" x2="{x0 + w - 10}" y2="{y:.1f}" '
                   'stroke="#c0392b" stroke-dasharray="6 4"/>')
        out.append(f'<text x="{x0 + left + 4}" y="{top - 6}" fill="#c0392b">'
                   f'- - {line_label}</text>')
        out.append(f'<text x="{x0 + left + (w - left) / 2}" y="{h - 4}" '
                   'text-anchor="middle" fill="#444">agents</text>')

    # Beside each of our bars, the raw durable queue's (grey) from the same moment.
    rate_bars = []
    for r in rows:
        rate_bars.append((str(r["agents"]), [(r["jobs_per_s"], "#3b6ea5")]))
        if "raw_jobs_per_s" in r:
            rate_bars.append((f"raw {r['agents']}", [(r["raw_jobs_per_s"], "#bdc3c7")]))
    top_rate = max([TARGET_JOBS_PER_S] + [v for _, st in rate_bars for v, _ in st]) * 1.15
    panel(0, f"jobs/s (echo, sandbox, {db}; grey: raw queue)", top_rate, rate_bars,
          TARGET_JOBS_PER_S, f"target: {TARGET_JOBS_PER_S} jobs/s", ".0f")
    ratios = [f"{r['agents']}: {r['jobs_per_s'] / r['raw_jobs_per_s']:.2f}×" for r in rows
              if r.get("raw_jobs_per_s")]
    if ratios:
        out.append(f'<text x="{left}" y="36" font-size="11" fill="#444">ours ÷ raw queue, '
                   f'by agents: {", ".join(ratios)} (target ≥ 0.5×)</text>')
    top_cpu = max([budget] + [sum(r["cpu_ms"].values()) for r in rows]) * 1.2
    panel(w, "CPU ms per job, by process", top_cpu,
          [(str(r["agents"]), [(r["cpu_ms"].get(k, 0.0), c) for k, c in PARTS])
           for r in rows],
          budget, f"budget at the target on {cores} cores: {budget:.1f} ms", ".1f")
    shown = [(k, c) for k, c in PARTS if any(k in r["cpu_ms"] for r in rows)]
    for i, (name, color) in enumerate(shown):
        x = w + 20 + i * 72
        out.append(f'<rect x="{x}" y="{h + 8}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{x + 14}" y="{h + 17}">{name}</text>')


def raw_column(r: dict, workers: int, args, url_for_raw: str | None) -> str:
    """The raw durable queue (bench/raw_queue.py) with as many workers as the row has agents,
    the same clients, slots and jobs, on the same kind of database, run right after the
    row so that both see the machine in the same state; its jobs/s and our ratio to it."""
    if args.no_raw:
        return ""
    from raw_queue import run_raw, sqlite_target
    with tempfile.TemporaryDirectory(prefix="sc-raw-") as tmp, \
            fresh_database(url_for_raw) as url:
        raw = run_raw(url or sqlite_target(Path(tmp)), workers, args.jobs, args.clients,
                      args.slots)
    r["raw_jobs_per_s"] = raw["jobs_per_s"]
    return f"   | {raw['jobs_per_s']:6.0f}  {r['jobs_per_s'] / raw['jobs_per_s']:5.2f}x"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--agents", default="1,2,4")
    ap.add_argument("--jobs", type=int, default=600)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--split", type=int, default=1,
                    help="jobs per client request: n > 1 sends split requests of n sibling "
                         "jobs (client.generate(..., n=N)); default 1, one job per request")
    ap.add_argument("--per-request", type=int, default=1, metavar="K",
                    help="independent jobs per client request: K > 1 sends K job requests "
                         "in one POST /v1/jobs/bulk (client.generate_many); with --split, "
                         "K split requests of n; default 1")
    ap.add_argument("--no-sandbox", action="store_true")
    ap.add_argument("--tls", action="store_true",
                    help="run each agent count in plaintext and over TLS (both hops), and "
                         "print what TLS costs")
    ap.add_argument("--svg", type=Path, help="also draw the figures into this SVG file")
    ap.add_argument("--db", help="the broker's database: sqlite (as make demo runs, the "
                    "default), a PostgreSQL server's URL (each run gets a fresh database "
                    "there), or both separated by a comma: one table each, one SVG")
    ap.add_argument("--no-raw", action="store_true",
                    help="skip the raw durable queue (bench/raw_queue.py) run beside each row")
    ap.add_argument("--replicas", help="run N broker replicas on the --db PostgreSQL server "
                    "(N: 1, 2 … N in turn; or a list like 1,3), agents on the first, "
                    "clients spread over all: jobs/s and same- vs cross-replica latency")
    ap.add_argument("--metrics", default="on",
                    help="on, off, or on,off: each agent count with the broker's metrics "
                         "on and off in the same run, and what they cost (default on)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of each agent count and metrics mode (alternating order)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds is {args.rounds}; give 1 or more")
    if not 1 <= args.per_request * args.split <= 256:
        ap.error(f"--per-request {args.per_request} × --split {args.split} jobs per request: "
                 "give 1 to 256 (what one POST /v1/jobs/bulk creates at most)")
    modes = [m.strip() for m in args.metrics.split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes):
        ap.error(f"--metrics is {args.metrics!r}; give on, off or on,off")
    dbs = [None if d.strip().lower() == "sqlite" else d.strip()
           for d in (args.db or "sqlite").split(",") if d.strip()]
    bad = [d for d in dbs if d is not None and not d.startswith("postgresql")]
    if bad or not dbs:
        ap.error(f"--db {args.db!r}: give sqlite, a PostgreSQL server's URL "
                 "(postgresql+psycopg://…), or both separated by a comma")
    if args.replicas and (len(dbs) != 1 or dbs[0] is None):
        ap.error("--replicas needs one --db postgresql+psycopg://… (replicas share PostgreSQL; "
                 "SQLite serves one broker process)")
    args.db = dbs[0]
    sandbox = not args.no_sandbox and shutil.which("bwrap") is not None

    direct = direct_call_ms()
    d50, d99 = statistics.median(direct), pct(direct, 99)
    print(f"direct in-process echo call: p50 {d50:.3f} ms, p99 {d99:.3f} ms")
    if args.replicas:
        return main_replicas(args, sandbox, d50, d99)
    bands, failed = [], []
    for url in dbs:
        db = "PostgreSQL" if url else "SQLite"
        try:
            bands.append((db, run_table(args, url, db, sandbox, modes, d50, d99)))
        except Exception:  # noqa: BLE001 - the other databases' figures still count
            if len(dbs) == 1:
                raise
            traceback.print_exc()
            print(f"the {db} table failed (above); going on without it", flush=True)
            failed.append(db)
        if args.svg and bands:  # drawn after each table: a later failure keeps these
            write_svg(bands, args.svg, os.cpu_count() or 1)
    print("targets: >= 300 jobs/s, <= 15 ms added p50, >= 0.5x the raw queue. The CPU columns say where the "
          "machine's cores went during the throughput run (all processes share them).")
    if args.svg and bands:
        print(f"figures drawn in {args.svg}")
    return 1 if failed else 0


def run_table(args, url: str | None, db: str, sandbox: bool, modes: list[str], d50: float,
              d99: float) -> list[dict]:
    """The table for one database (``url``: None for SQLite), printed as it runs; its rows."""
    print(f"broker path: {db}, sandbox {'on' if sandbox else 'off'}, {args.clients} clients, "
          f"{args.slots} slot(s) per agent, "
          + (f"{args.per_request} independent job requests per request (bulk)"
             + (f" of {args.split} split jobs each" if args.split > 1 else "")
             if args.per_request > 1 else
             f"{args.split} jobs per request (split)" if args.split > 1 else
             "one job per request"))
    print(f"{'agents':>6} {'hops':>9} {'metrics':>7} {'jobs/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'added p50':>10} {'added p99':>10} {'p50 ÷ direct':>13}   CPU ms per job: broker / agents / "
          "plugin hosts / clients" + (" / database server" if db == "PostgreSQL" else "")
          + "   | statements / commits per job / receipts per settlement / assignments "
            "per message"
          + ("" if args.no_raw else "   | raw queue jobs/s, ours ÷ raw"))
    rows, pairs = [], []
    for n in [int(x) for x in args.agents.split(",")]:
        pair = {}
        # Rounds alternate the order of the modes, so drift over the run hits both alike.
        sequence = [m for rnd in range(args.rounds)
                    for m in (modes if rnd % 2 == 0 else modes[::-1])]
        for k, mode in enumerate(sequence):
            for tls in ((False, True) if args.tls else (False,)):
                with fresh_database(url) as fresh:
                    r = run_one(n, args.jobs, args.clients, args.slots, sandbox, fresh,
                                args.split, tls=tls, metrics=mode == "on",
                                per_request=args.per_request)
                pair.setdefault(tls, r)
                if not tls:
                    rows.append(r)
                p50, p99 = statistics.median(r["lat"]), pct(r["lat"], 99)
                c = r["cpu_ms"]
                # the raw queue once per agent count, beside its first plaintext row
                raw = raw_column(r, n, args, url_for_raw=url) if not tls and k == 0 else ""
                print(f"{n:>6} {'TLS' if tls else 'plaintext':>9} {mode:>7} "
                      f"{r['jobs_per_s']:>8.0f} {p50:>8.2f} {p99:>8.2f} "
                      f"{p50 - d50:>10.2f} {p99 - d99:>10.2f} {p50 / max(d50, 1e-6):>12.0f}x   "
                      f"{c['broker']:6.2f} / "
                      f"{c['agents']:5.2f} / {c['hosts']:5.2f} / {c['clients']:5.2f}"
                      + (f" / {c['database']:5.2f}" if "database" in c else "")
                      + (f"   | {r['db_per_job']['statements']:5.1f} / "
                         f"{r['db_per_job']['commits']:4.2f} / "
                         f"{r['db_per_job']['batch']:4.2f} / "
                         f"{r['db_per_job']['assign_batch']:4.2f}" if r["db_per_job"]
                         else "   |   n/a /  n/a /  n/a /  n/a") + raw,
                      flush=True)
        if args.tls:
            pairs.append((n, pair[False], pair[True]))
    for n, plain, tls in pairs:
        dp50 = statistics.median(tls["lat"]) - statistics.median(plain["lat"])
        dp99 = pct(tls["lat"], 99) - pct(plain["lat"], 99)
        print(f"TLS cost, {n} agent(s): {tls['jobs_per_s']:.0f} vs {plain['jobs_per_s']:.0f} "
              f"jobs/s ({tls['jobs_per_s'] / max(plain['jobs_per_s'], 1e-9):.2f}x), "
              f"{dp50:+.2f} ms p50 and {dp99:+.2f} ms p99 per job, broker CPU "
              f"{tls['cpu_ms']['broker']:.2f} vs {plain['cpu_ms']['broker']:.2f} ms per job")
    if "on" in modes:
        us = metrics_us_per_job()
        broker_ms = statistics.mean(r["cpu_ms"]["broker"] for r in rows if r["metrics"])
        print(f"metrics on the hot path, timed in-process: {us:.1f} us per job = "
              f"{us / 10 / broker_ms:.2f} % of the broker's {broker_ms:.2f} ms of CPU per job")
    if set(modes) == {"on", "off"}:
        for n in sorted({r["agents"] for r in rows}):
            on = [r for r in rows if r["agents"] == n and r["metrics"]]
            off = [r for r in rows if r["agents"] == n and not r["metrics"]]
            js_on = statistics.mean(r["jobs_per_s"] for r in on)
            js_off = statistics.mean(r["jobs_per_s"] for r in off)
            cpu_on = statistics.mean(r["cpu_ms"]["broker"] for r in on)
            cpu_off = statistics.mean(r["cpu_ms"]["broker"] for r in off)
            scrapes = [s for r in on for s in r["scrapes_ms"]]
            spread = max(_spread([r["jobs_per_s"] for r in group]) for group in (on, off))
            print(f"metrics cost, {n} agent(s): {js_on:.0f} jobs/s on, {js_off:.0f} off: "
                  f"{(js_off - js_on) / js_off * 100:+.1f} % of throughput (target <= 3 %; "
                  f"negative: on was faster; runs of one mode spread {spread:.0f} %); "
                  f"broker CPU {cpu_on:.2f} ms/job on, {cpu_off:.2f} off "
                  f"({(cpu_on - cpu_off) / cpu_off * 100:+.1f} %)"
                  + (f"; a scrape of /metrics took {statistics.median(scrapes):.1f} ms "
                     f"(median of {len(scrapes)})" if scrapes else ""))
    return rows


if __name__ == "__main__":
    sys.exit(main())
