"""Matches per second of the auction, in process and through the broker's storage.

    .venv/bin/python bench/auction.py [--seconds 1.0] [--seed 7]

For 10, 1,000 and 10,000 standing asks it times ``clear`` (threshold algorithm over the
order book's sorted views) and the naive baseline ``reference_clear`` (scan every ask,
check, score, full sort) on the same jobs in the same run, and prints the ratio; then the
same market on the dispatcher's storage path (see ``through_storage``). The
market is realistic rather than kind: most asks sit on two popular builds (so one bucket
holds about half of them), prices, speeds, queues, cold starts and reliabilities vary, one
provider in ten is under the broker's default reputation floor (0.5), some are busy,
offline, short of VRAM or linked to a client, and jobs mix priorities, sizes, VRAM needs
and splits. Prints figures; asserts nothing (DESIGN §1: no timed assertions).

Target: at least 5,000 matches/s with 10,000 asks.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.auction import (Ask, AuctionRules, JobSpec, NoMatch, OrderBook,  # noqa: E402
                            Priority, clear, reference_clear)

BUILDS = [("sd15", "1.0.0", "a" * 64), ("sdxl", "1.0.0", "b" * 64),
          ("llama", "2.0.0", "c" * 64), ("sd15", "0.9.0", "d" * 64),
          ("llama", "1.0.0", "e" * 64)]
BUILD_WEIGHTS = [0.5, 0.25, 0.15, 0.05, 0.05]
RULES = AuctionRules(reputation_floor=0.5)  # the broker's default floor


def make_market(n_asks: int, rng: random.Random) -> OrderBook:
    book = OrderBook(RULES)
    n_operators = max(1, n_asks // 3)
    for i in range(n_asks):
        plugin, version, digest = rng.choices(BUILDS, BUILD_WEIGHTS)[0]
        book.post(Ask(
            provider_id=f"prov-{i}", operator_id=f"op-{rng.randrange(n_operators)}",
            plugin=plugin, plugin_version=version, weights_digest=digest,
            price_micro_per_unit=rng.randint(50, 400),
            throughput_units_per_s=rng.uniform(0.5, 20.0),
            queue_s=rng.choice([0.0, 0.0, 0.0, rng.uniform(0, 60)]),
            cold_start_s=rng.choice([0.0, 0.0, rng.uniform(2, 20)]),
            reliability=rng.uniform(0.8, 1.0),
            reputation=rng.uniform(0, 0.5) if rng.random() < 0.1 else rng.uniform(0.5, 1),
            online=rng.random() > 0.05, slots_free=rng.choice([0, 1, 1, 1, 2]),
            vram_gb=rng.choice([8, 12, 16, 24, 24, 48, 80]),
            linked_accounts=frozenset({f"client-{rng.randrange(50)}"})))
    return book


def make_jobs(n: int, rng: random.Random) -> list[JobSpec]:
    jobs = []
    for _ in range(n):
        plugin, version, digest = rng.choices(BUILDS[:3], [0.6, 0.25, 0.15])[0]
        jobs.append(JobSpec(
            plugin=plugin, plugin_version=version, weights_digest=digest,
            work_units=rng.choice([2.6, 7.9, 15.7, 40.0, 256.0]),
            client_id=f"client-{rng.randrange(50)}", reserve_micro_per_unit=300,
            min_vram_gb=rng.choice([0, 8, 12, 16]),
            priority=rng.choice(list(Priority)),
            n_slots=rng.choice([1, 1, 1, 1, 4])))
    return jobs


def rate(fn, jobs, book, seconds: float) -> tuple[float, int]:
    """Matches per second (refusals count: the work was done) and the share refused."""
    rng = random.Random(1)
    done = refused = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for job in jobs:
            try:
                fn(job, book, rng, 0.0)
            except NoMatch:
                refused += 1
            done += 1
        if time.perf_counter() >= deadline:
            break
    return done / (time.perf_counter() - start), refused / done


def update_rate(book: OrderBook, seconds: float) -> float:
    """Capacity changes per second (each re-indexes the ask in every cached view)."""
    pids = [a.provider_id for a in book][:1_000]
    rng = random.Random(3)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for pid in pids:
            book.update_provider(pid, queue_s=rng.uniform(0, 60), slots_free=rng.choice([0, 1]))
        done += len(pids)
    return done / (time.perf_counter() - start)


def through_storage(n_asks: int, seconds: float) -> float:
    """Matches/s on the dispatcher's real path: standing asks held by the broker's
    MarketService (n_asks providers, each with a broker-measured θ), queued jobs read in
    batches from a migrated SQLite database, and each match leased through JobService.assign
    (a signed envelope plus a conditional UPDATE and its event in one transaction), then
    booked in and out of the winner's queue as the dispatcher does (a lease taken in the
    presence the market reads at assignment, given back when the job ends; here at once, so
    queues stay short)."""
    import tempfile
    import uuid
    from pathlib import Path

    from sqlalchemy.orm import sessionmaker

    from broker.blobs.local import LocalBlobStore
    from broker.catalog.registry import PluginCatalog
    from broker.jobs.model import Job, JobState
    from broker.jobs.presence import AgentSession, Lease
    from broker.jobs.service import JobService
    from broker.market.service import MarketService
    from broker.settings import BUILTIN_PLUGINS
    from broker.storage.accounts_sql import SqlAccountRepository
    from broker.storage.base import make_engine
    from broker.storage.jobs_sql import SqlJobRepository
    from broker.storage.migrate import upgrade
    from sdk.protocol.signing import KeyPair

    class Target(AgentSession):  # an agent's stream: the envelope is built and signed
        def send_assignment(self, envelope_bytes, signature):
            pass

    rng = random.Random(n_asks)
    market = MarketService(lambda plugin: 1_000_000, rng=rng)
    agent_key = KeyPair.generate().public_key_hex  # inputs are sealed to a real key
    for i in range(n_asks):
        pid = f"p{i}"
        market.presence.add(Target(provider_id=pid, public_key=agent_key,
                                   account_id=f"op{i}", plugins={"echo@1.0.0": f"{i:064x}"},
                                   slots=4))
        market.report_benchmark(pid, "echo", rng.uniform(1, 50))
        market.observe(pid, "echo", 10.0, rng.uniform(200, 10_000))
        market.post_ask(pid, "echo", rng.randint(100, 900_000))
    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(f"sqlite:///{Path(tmp) / 'bench.db'}")
        upgrade(engine)
        sessions = sessionmaker(engine, expire_on_commit=False)
        SqlAccountRepository(sessions).create_account("client", "bench", "client", 0.0)
        repo = SqlJobRepository(sessions)
        jobs = JobService(repo, LocalBlobStore(Path(tmp) / "blobs"),
                          PluginCatalog.from_folders([BUILTIN_PLUGINS]), KeyPair.generate())
        made = 0

        def refill(count):
            nonlocal made
            for _ in range(count):
                made += 1
                repo.create(Job(id=str(uuid.uuid4()), account_id="client", plugin="echo",
                                plugin_version="1.0.0", inputs={"text": "x"},
                                state=JobState.QUEUED, work_units=1.0 + made % 5,
                                created_at=made, updated_at=made), ("queued", {}))

        refill(2_000)
        done, busy = 0, 0.0  # inserting jobs is the submit path's cost: not timed here
        while busy < seconds:
            t0 = time.perf_counter()
            batch = repo.queued(limit=256)
            if not batch:
                refill(2_000)
                continue
            for job in batch:
                result = market.clear(market.spec(plugin="echo", version="1.0.0",
                                                  work_units=job.work_units,
                                                  client_id="client", job_id=job.id))
                award = result.awards[0]
                target = market.presence.get(award.provider_id)
                jobs.assign(job, target, award.price_micro_per_unit)
                market.presence.take(target, job.id,
                                     Lease(job.plugin, job.work_units, market.clock()))
                market.presence.give_back(target, job.id)
                done += 1
            busy += time.perf_counter() - t0
        rate_ = done / busy
        engine.dispose()
        return rate_


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="time per measurement")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    jobs = make_jobs(500, rng)
    print(f"{'asks':>7} {'largest bucket':>14} {'clear/s':>10} {'baseline/s':>11} "
          f"{'ratio':>7} {'refused':>8}")
    for n_asks in (10, 1_000, 10_000):
        book = make_market(n_asks, random.Random(args.seed + n_asks))
        largest = max(len(book.bucket(b) or ()) for b in BUILDS)
        fast, refused = rate(clear, jobs, book, args.seconds)
        slow, _ = rate(reference_clear, jobs, book, args.seconds)
        print(f"{n_asks:>7,} {largest:>14,} {fast:>10,.0f} {slow:>11,.0f} "
              f"{fast / slow:>6.1f}x {refused:>7.0%}*")
        storage = through_storage(n_asks, args.seconds)
        # Its own market (one build, single slots), so no ratio against the row above.
        print(f"{'':>7} through the broker's storage (SQLite, signed lease per match): "
              f"{storage:,.0f} matches/s")
    print("* share of jobs refused per pass (no eligible provider / terms), counted as matches")
    print(f"updates (queue or slot change, re-indexed in every view) at 10,000 asks: "
          f"{update_rate(book, args.seconds):,.0f}/s")
    # Worst case for the index: every ask on one build.
    book = OrderBook(RULES)
    src = make_market(10_000, random.Random(args.seed))
    for ask in src:
        book.post(Ask(**{**{f: getattr(ask, f) for f in ask.__slots__},
                         "plugin": "sd15", "plugin_version": "1.0.0",
                         "weights_digest": "a" * 64}))
    one = [j for j in jobs if j.plugin == "sd15"]
    fast, _ = rate(clear, one, book, args.seconds)
    slow, _ = rate(reference_clear, one, book, args.seconds)
    print(f"10,000 asks on one build: clear {fast:,.0f}/s, baseline {slow:,.0f}/s, "
          f"ratio {fast / slow:.1f}x")


if __name__ == "__main__":
    main()
