"""Many threads on the same PostgreSQL accounts at once: no overdraft, no lost update, a hold
resolves once, a key produces one transaction, and the totals come out exact."""
from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from broker.ledger import AccountId, AccountKind, Splits
from broker.ledger.errors import HoldAlreadyResolved, InsufficientCredits

from .conftest import sql_service

C = 1_000_000
THREADS = 8
ALICE = AccountId(AccountKind.CLIENT_AVAILABLE, "alice")
ALICE_HELD = AccountId(AccountKind.CLIENT_HELD, "alice")


@pytest.fixture
def pg_ledger(pg_url, clock):
    service, engine = sql_service(pg_url, clock)
    yield service
    engine.dispose()


def _run_threads(fn, n=THREADS):
    barrier = threading.Barrier(n)

    def start(i):
        barrier.wait()
        return fn(i)
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(start, range(n)))


def test_concurrent_holds_and_settlements_never_overdraw(pg_ledger):
    ledger = pg_ledger
    deposit_micro = 60 * C
    ledger.deposit("alice", deposit_micro, idempotency_key="d")

    def worker(i):
        rng = random.Random(i)
        done = {"captured": 0, "provider": 0, "fee": 0, "pending": 0, "refused": 0}
        for n in range(25):
            amount = rng.randint(1, 5 * C)
            try:
                hold = ledger.hold("alice", amount, f"job-{i}-{n}", idempotency_key=f"h-{i}-{n}")
            except InsufficientCredits:
                done["refused"] += 1
                continue
            if rng.random() < 0.3:  # left pending: keeps pressure on the balance
                done["pending"] += amount
                continue
            provider = rng.choice(["bob", "dave"])
            provider_micro = rng.randint(1, amount)
            fee = rng.randint(0, amount - provider_micro)
            ledger.post(hold.id, Splits(provider, provider_micro, fee_micro=fee),
                        idempotency_key=f"p-{i}-{n}")
            done["captured"] += provider_micro + fee
            done["provider"] += provider_micro
            done["fee"] += fee
        return done

    results = _run_threads(worker)
    total = {k: sum(r[k] for r in results) for k in results[0]}
    assert total["refused"] > 0, "the test should oversubscribe the balance"
    audit = ledger.verify()
    assert audit.ok, audit.problems
    assert ledger.balance(ALICE) >= 0
    assert ledger.balance(ALICE_HELD) == total["pending"]
    assert ledger.balance(ALICE) == deposit_micro - total["captured"] - total["pending"]
    vesting = sum(ledger.balance(AccountId(AccountKind.PROVIDER_VESTING, p)) for p in ("bob", "dave"))
    assert vesting == total["provider"]
    assert ledger.balance(AccountId.platform(AccountKind.PLATFORM_FEES)) == total["fee"]


def test_a_hold_resolves_once_under_concurrency(pg_ledger):
    ledger = pg_ledger
    ledger.deposit("alice", 100 * C, idempotency_key="d")
    holds = [ledger.hold("alice", 2 * C, f"job-{n}", idempotency_key=f"h{n}") for n in range(10)]

    def worker(i):
        wins = []
        for hold in holds:
            try:
                if i % 2:
                    ledger.void(hold.id, idempotency_key=f"v-{i}-{hold.id}")
                else:
                    ledger.post(hold.id, Splits("bob", C), idempotency_key=f"p-{i}-{hold.id}")
                wins.append(hold.id)
            except HoldAlreadyResolved:
                pass
        return wins

    wins = [h for r in _run_threads(worker) for h in r]
    assert sorted(wins) == sorted(h.id for h in holds)  # each exactly once
    assert ledger.balance(ALICE_HELD) == 0
    posted = sum(ledger.get_hold(h.id).captured_micro for h in holds)
    assert ledger.balance(ALICE) == 100 * C - posted
    assert ledger.verify().ok


def test_one_idempotency_key_one_transaction_under_concurrency(pg_ledger):
    ledger = pg_ledger
    ids = _run_threads(lambda i: ledger.deposit("alice", 5 * C, idempotency_key="evt_same").id)
    assert len(set(ids)) == 1
    assert ledger.balance(ALICE) == 5 * C
    assert ledger.verify().transactions == 1
