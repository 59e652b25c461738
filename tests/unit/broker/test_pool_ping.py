"""Pooled PostgreSQL connections are pinged only after they sat idle (issue #28: a ping on
every checkout was 2.4 statements per job): one killed while idle is replaced before it is
used, with no error to the caller; one checked in just now is used without a ping."""
import time

from sqlalchemy import text

from broker.storage import base


def _pid(engine) -> int:
    with engine.connect() as c:
        return c.execute(text("SELECT pg_backend_pid()")).scalar_one()


def test_a_connection_killed_while_idle_is_replaced_without_an_error(pg_url, monkeypatch):
    monkeypatch.setattr(base, "PING_IDLE_S", 0.05)
    engine = base.make_engine(pg_url, pool_size=1)
    killer = base.make_engine(pg_url, pool_size=1)
    try:
        first = _pid(engine)
        with killer.connect() as c:
            # (waits until the backend has gone, up to 5 s)
            assert c.execute(text("SELECT pg_terminate_backend(:p, 5000)"),
                             {"p": first}).scalar_one()
        time.sleep(0.1)  # idle past PING_IDLE_S
        assert _pid(engine) != first  # pinged, found dead, replaced: the query just works
    finally:
        engine.dispose()
        killer.dispose()


def test_a_connection_checked_in_just_now_is_not_pinged(pg_url, monkeypatch):
    monkeypatch.setattr(base, "PING_IDLE_S", 60.0)
    engine = base.make_engine(pg_url, pool_size=1)
    pings = []
    real = engine.dialect.do_ping
    monkeypatch.setattr(engine.dialect, "do_ping", lambda conn: pings.append(1) or real(conn))
    try:
        pids = {_pid(engine) for _ in range(5)}
        assert len(pids) == 1 and pings == []  # one connection, reused, never pinged
    finally:
        engine.dispose()
