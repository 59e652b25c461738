"""broker.providers.presence on the real providers table (SQLite, PostgreSQL): which builds
a provider known to the broker serves — connected to this process now, or seen by any
replica within the window — and the last-seen times it keeps fresh."""
from broker.providers.model import Provider
from broker.providers.presence import BuildsServed
from broker.storage.accounts_sql import SqlAccountRepository, SqlProviderRepository
from broker.storage.base import make_engine
from broker.storage.migrate import upgrade
from sqlalchemy.orm import sessionmaker

from broker_fixtures import FakeClock


def _repo(db_url):
    engine = make_engine(db_url)
    upgrade(engine)
    sessions = sessionmaker(engine, expire_on_commit=False)
    SqlAccountRepository(sessions).create_account("acct", "operator", "provider", 0.0)
    return engine, SqlProviderRepository(sessions)


def _provider(pid, seen, plugins=(("echo", "1.0.0"),), status="active"):
    return Provider(id=pid, account_id="acct", public_key=pid.ljust(64, "0"), status=status,
                    plugins=[{"name": n, "version": v} for n, v in plugins],
                    created_at=seen, last_seen_at=seen)


def test_a_build_is_served_while_a_provider_is_connected_or_seen_within_the_window(db_url):
    engine, repo = _repo(db_url)
    clock = FakeClock(1000.0)
    connected: dict = {}
    presence = BuildsServed(repo, lambda p, v: any((p, v) in b for b in connected.values()),
                        lambda: connected, window_s=60, clock=clock)
    assert not presence.serves("echo", "1.0.0")
    repo.add(_provider("p1", seen=990.0))
    assert presence.serves("echo", "1.0.0") and not presence.serves("echo", "2.0.0")
    assert not presence.serves("sd15", "1.0.0")
    clock.advance(60)  # last seen 70 s ago, out of the window (a yes is cached 2 s, passed)
    assert not presence.serves("echo", "1.0.0")
    connected["p2"] = {("echo", "1.0.0")}  # connected here: no database needed
    assert presence.serves("echo", "1.0.0")
    repo.add(_provider("p3", seen=clock(), plugins=[("sd15", "1.0.0")], status="banned"))
    assert not presence.serves("sd15", "1.0.0")  # a banned provider cannot come back
    engine.dispose()


def test_refresh_keeps_connected_providers_present_for_other_replicas(db_url):
    engine, repo = _repo(db_url)
    clock = FakeClock(1000.0)
    repo.add(_provider("p1", seen=1000.0))
    connected = {"p1": {("echo", "1.0.0")}}
    here = BuildsServed(repo, lambda p, v: False, lambda: connected, window_s=60, clock=clock)
    elsewhere = BuildsServed(repo, lambda p, v: False, lambda: [], window_s=60,
                         clock=clock)  # another replica
    assert here.refresh() == 1
    for _ in range(10):  # connected for ten minutes: refreshed every quarter window
        clock.advance(60)
        here.refresh()
        assert elsewhere.serves("echo", "1.0.0")
    assert here.refresh() == 0  # nothing due yet
    clock.advance(30)
    here.left("p1")  # the stream ended: seen until now
    connected.clear()
    clock.advance(59)
    assert elsewhere.serves("echo", "1.0.0")
    clock.advance(2)
    assert not elsewhere.serves("echo", "1.0.0")
    engine.dispose()
