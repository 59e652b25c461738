"""Fixtures for the ledger tests: a service over the in-memory repository or over the SQL
repository on a fresh database, with a fake clock."""
from __future__ import annotations

import pytest

from broker.ledger import LedgerService
from broker.ledger.memory import FakeClock, InMemoryLedgerRepository

VESTING_WINDOW_S = 3600


def open_parties(service: LedgerService) -> LedgerService:
    service.open_platform_accounts()
    for client in ("alice", "carol"):
        service.open_client(client)
    for provider in ("bob", "dave"):
        service.open_provider(provider)
    service.open_publisher("pub")
    return service


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def memory_service(clock):
    return open_parties(LedgerService(InMemoryLedgerRepository(), clock=clock,
                                      vesting_window_s=VESTING_WINDOW_S))


def sql_service(url: str, clock, **kwargs) -> tuple[LedgerService, object]:
    from broker.storage.base import make_engine
    from broker.storage.ledger_sql import SqlLedgerRepository, create_ledger_tables

    engine = make_engine(url)
    create_ledger_tables(engine)
    service = LedgerService(SqlLedgerRepository(engine), clock=clock,
                            vesting_window_s=VESTING_WINDOW_S, **kwargs)
    return open_parties(service), engine


@pytest.fixture
def sql_ledger(db_url, clock):
    service, engine = sql_service(db_url, clock)
    yield service
    engine.dispose()
