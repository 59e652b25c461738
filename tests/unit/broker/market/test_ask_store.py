"""AskStore: the in-memory and the SQL store keep the same contract (SQLite and
PostgreSQL), and a market built on a store gets its asks and rules back after a restart."""
import random

import pytest
from sqlalchemy.orm import sessionmaker

from broker.market import MarketService, MarketSettings
from broker.market.store import InMemoryAskStore
from broker.providers.model import Provider
from broker.storage.accounts_sql import SqlAccountRepository, SqlProviderRepository
from broker.storage.base import make_engine
from broker.storage.market_sql import SqlAskStore
from broker.storage.migrate import upgrade

from .agents import connect


@pytest.fixture
def sql_store(db_url):
    engine = make_engine(db_url)
    upgrade(engine)
    sessions = sessionmaker(engine, expire_on_commit=False)
    SqlAccountRepository(sessions).create_account("acct", "op", "provider", 0.0)
    for pid in ("p1", "p2"):
        SqlProviderRepository(sessions).add(Provider(id=pid, account_id="acct",
                                                     public_key=pid * 32))
    yield SqlAskStore(sessions)
    engine.dispose()


def test_in_memory_store_contract():
    _contract(InMemoryAskStore())
    _restart(InMemoryAskStore())


def test_sql_store_contract(sql_store):
    _contract(sql_store)


def test_sql_store_across_a_restart(sql_store):
    _restart(sql_store)


def _contract(store):
    assert store.load_asks() == {} and store.load_rules() == {}
    store.save_ask("p1", "echo", 300, at=1.0)
    store.save_ask("p1", "sd15", 2_000, at=2.0)
    store.save_ask("p2", "echo", 400, at=3.0)
    store.save_ask("p1", "echo", 250, at=4.0)  # replaces
    assert store.load_asks() == {"p1": {"echo": 250, "sd15": 2_000}, "p2": {"echo": 400}}
    store.save_rule("reputation_floor", 0.7, by="admin-1", at=5.0)
    store.save_rule("reputation_floor", 0.6, by="admin-1", at=6.0)
    assert store.load_rules() == {"reputation_floor": 0.6}


def market_on(store, clock=lambda: 1_000.0):
    return MarketService(lambda plugin: 1_000, MarketSettings(), rng=random.Random(3),
                         clock=clock, store=store)


def _restart(store):
    """A restarted broker keeps asks and the admin's floor."""
    before = market_on(store)
    connect(before, "p1", "op-1", {"echo": "1.0.0"}, asks={"echo": 300})
    connect(before, "p2", "op-2", {"echo": "1.0.0"})
    before.post_ask("p2", "echo", 400)
    before.set_reputation_floor(0.8, by="admin-1")

    after = market_on(store)  # the broker restarted; nobody has reconnected yet
    assert after.rules.reputation_floor == 0.8
    rows = {r["provider_id"]: r for r in after.asks()}
    assert rows["p1"]["price_micro_per_unit"] == 300 and rows["p1"]["online"] is False
    assert set(after.asks({"p2"})[0]) == set(rows["p1"])  # same shape as a live row
    # The agent reconnects without re-posting: its ask stands, it is not at the reserve.
    connect(after, "p1", "op-1", {"echo": "1.0.0"})
    after.observe("p1", "echo", 10, 1000.0)
    [row] = after.asks({"p1"})
    assert row["price_micro_per_unit"] == 300 and not row["at_reserve"] and row["online"]
    res = after.clear(after.spec(plugin="echo", version="1.0.0", work_units=1, client_id="c"))
    assert res.winner.provider_id == "p1"
