"""Ledger throughput: transactions per second for hold+post cycles (two transactions each:
the hold and its settlement) and plain two-leg transfers (deposits), on the in-memory
repository (the baseline), SQLite (a temp file, WAL) and PostgreSQL (a temp database on the
local server; skipped with a note when unreachable). Every operation is its own database
transaction with its idempotency record, as in production. One thread, then hold+post
with several clients settling at once against the same provider and fee accounts.

    python bench/ledger.py [--transactions 2000] [--threads 8] [--postgres-url postgresql+psycopg://...]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.ledger import LedgerService, Splits  # noqa: E402
from broker.ledger.memory import FakeClock, InMemoryLedgerRepository  # noqa: E402

C = 1_000_000
DEFAULT_PG = os.environ.get("SPARECYCLES_TEST_POSTGRES_URL",
                            "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


def _service(repo) -> LedgerService:
    service = LedgerService(repo, clock=FakeClock())
    service.open_platform_accounts()
    service.open_client("alice")
    service.open_provider("bob")
    service.open_publisher("pub")
    return service


def measure(service: LedgerService, transactions: int) -> dict[str, float]:
    """Transactions per second for each workload."""
    service.deposit("alice", 10**6 * C, idempotency_key="bench-funding")
    cycles = transactions // 2
    start = time.perf_counter()
    for n in range(cycles):
        hold = service.hold("alice", 5 * C, f"job-{n}", idempotency_key=f"h{n}")
        service.post(hold.id, Splits("bob", 3 * C, fee_micro=C // 2, publisher="pub",
                                     royalty_micro=C // 10), idempotency_key=f"p{n}")
    hold_post = 2 * cycles / (time.perf_counter() - start)
    start = time.perf_counter()
    for n in range(transactions):
        service.deposit("alice", C, idempotency_key=f"t{n}")
    transfers = transactions / (time.perf_counter() - start)
    audit = service.verify()
    assert audit.ok, audit.problems
    return {"hold+post": hold_post, "transfer": transfers}


def measure_threaded(service: LedgerService, transactions: int, threads: int) -> float:
    """Hold+post transactions per second with ``threads`` clients settling at once (each its
    own client, all paying the same provider, publisher and platform fee accounts)."""
    from concurrent.futures import ThreadPoolExecutor

    clients = [f"client-{i}" for i in range(threads)]
    for i, client in enumerate(clients):
        service.open_client(client)
        service.deposit(client, 10**6 * C, idempotency_key=f"fund-{client}")
    cycles = transactions // 2 // threads

    def run(client: str) -> None:
        for n in range(cycles):
            hold = service.hold(client, 5 * C, f"{client}-job-{n}", idempotency_key=f"{client}-h{n}")
            service.post(hold.id, Splits("bob", 3 * C, fee_micro=C // 2), idempotency_key=f"{client}-p{n}")

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, clients))
    return 2 * cycles * threads / (time.perf_counter() - start)


def _sql(url: str, transactions: int, threads: int) -> dict[str, float]:
    from broker.storage.base import make_engine
    from broker.storage.ledger_sql import SqlLedgerRepository, create_ledger_tables

    engine = make_engine(url)
    try:
        create_ledger_tables(engine)
        service = _service(SqlLedgerRepository(engine))
        figures = measure(service, transactions)
        figures["threaded"] = measure_threaded(service, transactions, threads)
        return figures
    finally:
        engine.dispose()


def _postgres(admin_url: str, transactions: int, threads: int) -> dict[str, float] | str:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"sc_bench_{uuid.uuid4().hex[:10]}"
    try:
        admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # noqa: BLE001 - any failure means "no server here"
        return f"PostgreSQL at {admin_url} unreachable ({type(exc).__name__}); skipped"
    try:
        url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
        return _sql(url, transactions, threads)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        admin.dispose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transactions", type=int, default=2000)
    parser.add_argument("--postgres-url", default=DEFAULT_PG)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args(argv)

    results: dict[str, dict[str, float] | str] = {}
    memory = _service(InMemoryLedgerRepository())
    results["memory"] = measure(memory, args.transactions)
    results["memory"]["threaded"] = measure_threaded(memory, args.transactions, args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        results["sqlite"] = _sql(f"sqlite:///{Path(tmp) / 'ledger.db'}", args.transactions, args.threads)
    results["postgresql"] = _postgres(args.postgres_url, args.transactions, args.threads)

    base = results["memory"]
    print(f"ledger throughput, {args.transactions} transactions per workload")
    print(f"{'backend':<12}{'hold+post txn/s':>17}{'memory is':>11}{'transfer txn/s':>17}"
          f"{'memory is':>11}{f'hold+post, {args.threads} threads':>26}")
    for backend, figures in results.items():
        if isinstance(figures, str):
            print(f"{backend:<12}{figures}")
            continue
        hp, tr = figures["hold+post"], figures["transfer"]
        print(f"{backend:<12}{hp:>17,.0f}{base['hold+post'] / hp:>10.1f}x"
              f"{tr:>17,.0f}{base['transfer'] / tr:>10.1f}x{figures['threaded']:>20,.0f} txn/s")


if __name__ == "__main__":
    main()
