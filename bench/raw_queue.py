"""The yardstick for bench/dispatch.py: the simplest durable job queue that does the same work.

A client inserts a job row and commits; a worker claims the oldest queued row (PostgreSQL:
``FOR UPDATE SKIP LOCKED``; SQLite, which has no row locks: one ``UPDATE … RETURNING`` in a
write transaction), runs the echo plugin on it, marks it done with its output and commits;
then the waiting client is told. Nothing else: no auth, no prices, no ledger, no audit, no
signatures, no sandbox. Whatever the broker does beyond this is what its ratio to this
queue measures.

Workers are separate processes (as agents are), each with ``slots`` threads; clients are
threads of the calling process (as in bench/dispatch.py), each with its own connection.
Wake-ups cross processes through a multiprocessing semaphore (one release per committed
job, so a row is always committed behind a release; on PostgreSQL a claim's snapshot may
not see it yet, and the worker claims again) and a queue of finished ids, so neither side
polls the database.

    python bench/raw_queue.py [--db postgresql+psycopg://postgres@127.0.0.1:5432/postgres]
                              [--workers 1,2,4] [--slots 8] [--clients 32] [--jobs 600]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = ("CREATE TABLE raw_jobs (id TEXT PRIMARY KEY, inputs TEXT NOT NULL, "
          "state TEXT NOT NULL, output TEXT, created_at DOUBLE PRECISION NOT NULL)")
INDEX = "CREATE INDEX raw_jobs_queued ON raw_jobs (created_at) WHERE state = 'queued'"
CLAIM_PG = ("UPDATE raw_jobs SET state = 'running' WHERE id = (SELECT id FROM raw_jobs "
            "WHERE state = 'queued' ORDER BY created_at LIMIT 1 FOR UPDATE SKIP LOCKED) "
            "RETURNING id, inputs")
CLAIM_SQLITE = ("UPDATE raw_jobs SET state = 'running' WHERE id = (SELECT id FROM raw_jobs "
                "WHERE state = 'queued' ORDER BY created_at LIMIT 1) RETURNING id, inputs")


class Database:
    """One connection to the queue's database, PostgreSQL (psycopg 3) or SQLite, with the
    statements written once for both (``?`` placeholders become ``%s`` on PostgreSQL)."""

    def __init__(self, target: str):
        self.postgres = target.startswith("postgresql")
        if self.postgres:
            import psycopg
            self.conn = psycopg.connect(_libpq_url(target))
        else:
            # The broker's own settings for its SQLite file (broker/storage/base.py).
            self.conn = sqlite3.connect(target, timeout=30, isolation_level=None,
                                        check_same_thread=False)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.execute("PRAGMA busy_timeout=30000")

    def run(self, sql: str, args: tuple = ()) -> list[tuple]:
        """One statement in its own committed transaction; the rows it returned."""
        if self.postgres:
            with self.conn.transaction():
                cur = self.conn.execute(sql.replace("?", "%s"), args)
                return cur.fetchall() if cur.description else []
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            rows = self.conn.execute(sql, args).fetchall()
            self.conn.execute("COMMIT")
            return rows
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self.conn.close()


def _libpq_url(url: str) -> str:
    """psycopg takes libpq URLs: drop SQLAlchemy's ``+psycopg`` driver suffix."""
    scheme, rest = url.split("://", 1)
    return "postgresql://" + rest


def _echo():
    """The echo plugin's own run, as the agents' plugin hosts call it."""
    from plugins import builtin_plugin_dir
    from plugins.api import load_manifest
    sys.path.insert(0, str(builtin_plugin_dir("echo")))
    from plugin import Echo  # type: ignore

    class Ctx:
        job_id = "raw"
        scratch_dir = Path(tempfile.gettempdir())

        def progress(self, *a): pass
        def stream(self, *a): pass
        def cancelled(self): return False
        def check_cancelled(self): pass

    manifest = load_manifest(builtin_plugin_dir("echo"))
    plugin = Echo()
    plugin.setup(None, "cpu")
    return lambda inputs: plugin.run(manifest.validate_inputs(inputs), Ctx())


def _worker_process(target: str, slots: int, queued, finished, stopping) -> None:
    run = _echo()

    def slot() -> None:
        db = Database(target)
        claim = CLAIM_PG if db.postgres else CLAIM_SQLITE
        while True:
            queued.acquire()
            rows = db.run(claim)
            while not rows and not stopping.is_set():
                # A release always has a committed row behind it, but on PostgreSQL not
                # always one this claim's snapshot sees: woken by the release of job A
                # while job B was committing, the claim found A taken by the worker woken
                # for B and B not yet visible. The next statement's snapshot sees B.
                stopping.wait(0.001)
                rows = db.run(claim)
            if not rows:  # the stop signal: a release with no row behind it
                db.close()
                return
            job_id, inputs = rows[0]
            output = run(json.loads(inputs))
            db.run("UPDATE raw_jobs SET state = 'done', output = ? WHERE id = ?",
                   (json.dumps(output, default=str), job_id))
            finished.put(job_id)

    threads = [threading.Thread(target=slot, daemon=True) for _ in range(slots)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class RawQueue:
    """The queue's workers, started on a fresh table, and a client-side ``submit_and_wait``."""

    def __init__(self, target: str, workers: int, slots: int):
        self.target = target
        db = Database(target)
        db.run("DROP TABLE IF EXISTS raw_jobs")
        db.run(SCHEMA)
        db.run(INDEX)
        db.close()
        ctx = mp.get_context("spawn")
        self.queued = ctx.Semaphore(0)
        self.finished = ctx.Queue()
        self.stopping = ctx.Event()
        self.procs = [ctx.Process(target=_worker_process,
                                  args=(target, slots, self.queued, self.finished,
                                        self.stopping), daemon=True)
                      for _ in range(workers)]
        self.slots = workers * slots
        for p in self.procs:
            p.start()
        self._waiting: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._reader = threading.Thread(target=self._read_finished, daemon=True)
        self._reader.start()

    def _read_finished(self) -> None:
        while True:
            job_id = self.finished.get()
            if job_id is None:
                return
            with self._lock:
                event = self._waiting.pop(job_id, None)
            if event is not None:
                event.set()

    def submit_and_wait(self, inputs: dict, timeout: float = 60.0) -> None:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = Database(self.target)
        job_id = str(uuid.uuid4())
        event = threading.Event()
        with self._lock:
            self._waiting[job_id] = event
        db.run("INSERT INTO raw_jobs (id, inputs, state, created_at) VALUES (?, ?, 'queued', ?)",
               (job_id, json.dumps(inputs), time.time()))
        self.queued.release()
        if not event.wait(timeout):
            raise TimeoutError(f"raw queue: job {job_id} not done within {timeout}s")

    def stop(self) -> None:
        self.stopping.set()
        for _ in range(self.slots):
            self.queued.release()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.finished.put(None)
        self._reader.join(timeout=10)
        self.finished.close()
        self.finished.join_thread()


def run_raw(target: str, workers: int, jobs: int, clients: int, slots: int) -> dict:
    """Added-latency samples (one client, one job at a time) and closed-loop jobs/s with
    ``clients`` threads, as bench/dispatch.py measures the broker."""
    queue = RawQueue(target, workers, slots)
    try:
        for _ in range(20):
            queue.submit_and_wait({"text": "warm"})
        lat = []
        for _ in range(min(jobs, 200)):
            t = time.perf_counter()
            queue.submit_and_wait({"text": "x"})
            lat.append((time.perf_counter() - t) * 1000)
        per_client = max(1, jobs // clients)
        done = 0
        lock = threading.Lock()

        def client() -> None:
            nonlocal done
            for _ in range(per_client):
                queue.submit_and_wait({"text": "y"})
                with lock:
                    done += 1

        threads = [threading.Thread(target=client) for _ in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        return {"workers": workers, "lat": lat, "jobs_per_s": done / elapsed, "done": done}
    finally:
        queue.stop()


def sqlite_target(folder: Path) -> str:
    return str(folder / "raw_queue.db")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--db", help="a PostgreSQL server's URL (a fresh database there, dropped "
                    "after); default: a SQLite file in a temporary folder")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--jobs", type=int, default=600)
    args = ap.parse_args()
    from dispatch import fresh_database, pct  # the broker runs' fresh-database rule
    print(f"{'workers':>7} {'jobs/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for n in [int(x) for x in args.workers.split(",")]:
        with tempfile.TemporaryDirectory(prefix="sc-raw-") as tmp, \
                fresh_database(args.db) as url:
            r = run_raw(url or sqlite_target(Path(tmp)), n, args.jobs, args.clients, args.slots)
        print(f"{n:>7} {r['jobs_per_s']:>8.0f} {statistics.median(r['lat']):>8.2f} "
              f"{pct(r['lat'], 99):>8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
