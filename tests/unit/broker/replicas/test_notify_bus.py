"""PgNotifyBus on a real PostgreSQL: wake-ups reach the other replica, not the sender; a
burst packs into few notifications; a dropped LISTEN connection is followed by a catch-up."""
from __future__ import annotations

import json
import threading
import time

import psycopg

from broker.storage.notify_pg import MAX_PAYLOAD, PgNotifyBus, conninfo_of


def _collect(bus, kind):
    got, ev = [], threading.Event()

    def handler(data):
        got.append(data)
        ev.set()
    bus.subscribe(kind, handler)
    return got, ev


def _until(pred, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not pred():
        time.sleep(0.01)
    return pred()


def test_a_message_reaches_the_other_replica_only(pg_url):
    a, b = PgNotifyBus(pg_url, replica_id="a"), PgNotifyBus(pg_url, replica_id="b")
    got_a, _ = _collect(a, "job")
    got_b, ev = _collect(b, "job")
    a.start(), b.start()
    try:
        t0 = time.monotonic()
        a.publish("job", {"j": "x", "e": 1})
        assert ev.wait(2)
        assert time.monotonic() - t0 < 0.5
        assert got_b == [{"j": "x", "e": 1}]
        time.sleep(0.1)
        assert got_a == []  # its own message does not come back
    finally:
        a.close(), b.close()


def test_a_burst_is_packed_into_few_notifications(pg_url):
    a, b = PgNotifyBus(pg_url, replica_id="a"), PgNotifyBus(pg_url, replica_id="b")
    a.pool_size = 0  # every sending connection busy: all of it goes through the sender thread
    got, _ = _collect(b, "queued")
    a.start(), b.start()
    try:
        for i in range(2000):
            a.publish("queued", {"j": [f"{i:036d}"]})
        assert _until(lambda: len(got) == 2000)
        assert [d["j"][0] for d in got] == [f"{i:036d}" for i in range(2000)]  # in order
        assert a.sent < 2000 / 20  # many messages per notification
    finally:
        a.close(), b.close()


def test_pack_keeps_each_payload_under_the_limit():
    bus = PgNotifyBus("postgresql+psycopg://u@127.0.0.1/db", replica_id="r")
    payloads = bus._pack([("job", {"j": "x" * 36})] * 1000 + [("big", {"x": "y" * 9000})])
    assert all(len(p) <= MAX_PAYLOAD for p in payloads)
    assert sum(len(json.loads(p)["m"]) for p in payloads) == 1000  # the oversized one dropped


def test_a_lost_listen_connection_catches_up(pg_url):
    a, b = PgNotifyBus(pg_url, replica_id="a"), PgNotifyBus(pg_url, replica_id="b")
    gaps = []
    b.on_gap(lambda: gaps.append(1))
    got, _ = _collect(b, "job")
    a.start(), b.start()
    try:
        with psycopg.connect(conninfo_of(pg_url), autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE application_name = %s", ("sparecycles-bus b",))
        assert _until(lambda: gaps, 10)  # it listens again and says it may have missed some
        a.publish("job", {"j": "after"})
        assert _until(lambda: {"j": "after"} in got)
    finally:
        a.close(), b.close()
