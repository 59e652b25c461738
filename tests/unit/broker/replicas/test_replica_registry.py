"""ReplicaRegistry on the real tables (SQLite and PostgreSQL): who holds which agent's
stream, believed only while the holder beats; a stale replica is buried with its streams;
a replica with another signing key is refused."""
from __future__ import annotations

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker

from broker.providers.model import Provider
from broker.replicas.service import ReplicaMismatch, ReplicaRegistry
from broker.storage.accounts_sql import SqlAccountRepository, SqlProviderRepository
from broker.storage.migrate import upgrade
from broker.storage.replicas_sql import SqlReplicaStore


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_streams_are_believed_while_their_replica_beats(db_url):
    engine = create_engine(db_url)
    upgrade(engine)
    sessions = sessionmaker(engine, expire_on_commit=False)
    SqlAccountRepository(sessions).create_account("op", "op", "provider", 0.0)
    providers = SqlProviderRepository(sessions)
    for pid in ("p1", "p2"):
        providers.add(Provider(id=pid, account_id="op", public_key=pid * 32, created_at=0.0,
                               last_seen_at=0.0))
    clock = Clock()
    store = SqlReplicaStore(sessions)
    a = ReplicaRegistry(store, "a", "k" * 64, clock=clock, stale_after_s=15)
    b = ReplicaRegistry(store, "b", "k" * 64, clock=clock, stale_after_s=15)
    a.join(), b.join()
    a.hold("p1")
    b.hold("p2")
    assert b.held_elsewhere() == {"p1": "a"} and a.held_elsewhere() == {"p2": "b"}
    with pytest.raises(ReplicaMismatch, match="SPARECYCLES_BROKER_SIGNING_KEY"):
        ReplicaRegistry(store, "c", "x" * 64, clock=clock).join()
    clock.t += 20  # a stops beating (SIGKILLed); b beats on
    store.beat("b", clock.t)
    assert b.held_elsewhere() == {}  # a's stream is no longer believed
    assert store.bury(clock.t - 15) == ["a"]
    assert store.holders(clock.t - 15) == {"p2": "b"}
    b.release("p2")
    assert store.holders(clock.t - 15) == {}
    engine.dispose()
