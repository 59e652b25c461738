"""What replicas say to each other and what they store is sealed with one at-rest key
(issues #21, #23): the wake-ups that cross replicas through LISTEN/NOTIFY carry job data
(a queued job whole, an ended job's copy) and are sealed, so a role that can LISTEN (or
PostgreSQL's log) sees ciphertext; a payload that does not open is a catch-up, not a crash;
and the database records which key it is sealed with, so a replica with another key (or
none) is refused at start instead of writing what the others cannot read."""
from __future__ import annotations

import base64
import json
import logging
import os
import threading
import time
import uuid

import psycopg
import pytest

from broker.api.job_request import job_request
from broker.settings import Settings
from broker.storage.notify_pg import (CATCH_UP_EVERY_S, CHANNEL, MAX_PAYLOAD, PgNotifyBus,
                                      conninfo_of)
from broker.storage.sealed import AtRestCipher, AtRestMismatch
from sdk import Client

from tests.integration.conftest import LiveBroker, agent_starter, seen_provider


def _key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


def _until(pred, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not pred():
        time.sleep(0.01)
    return pred()


class Eavesdropper:
    """A database role's own connection listening on the replicas' channel: what it can
    read of their wake-ups (what PostgreSQL would log of them, too)."""

    def __init__(self, pg_url: str):
        self.conn = psycopg.connect(conninfo_of(pg_url), autocommit=True)
        self.conn.execute(f'LISTEN "{CHANNEL}"')
        self.payloads: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            for note in self.conn.notifies(timeout=0.2):
                self.payloads.append(note.payload)

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.conn.close()


@pytest.fixture
def replicas(tmp_path, pg_url):
    shared = {"key_path": tmp_path / "broker.key", "blob_dir": tmp_path / "blobs",
              "at_rest_key": _key()}
    a = LiveBroker(tmp_path / "a", db_url=pg_url, **shared)
    b = LiveBroker(tmp_path / "b", db_url=pg_url, **shared)
    yield a, b
    b.stop()
    a.stop()


def test_wake_ups_across_replicas_carry_no_prompt_or_output_in_plaintext(replicas, pg_url):
    a, b = replicas
    spy = Eavesdropper(pg_url)
    start, stop_all = agent_starter(a)
    try:
        start("a1")
        prompts = [f"secret-prompt-{uuid.uuid4().hex}" for _ in range(3)]
        with Client(b.url, b.key("client")) as client:  # submitted on B, run through A
            for p in prompts:
                assert client.generate("echo", text=p, timeout=30).json[0]["text"] == p
        assert _until(lambda: len(spy.payloads) >= 2)
    finally:
        stop_all()
        spy.close()
    assert b.services.dispatcher.session_count() == 0  # the jobs crossed replicas
    for payload in spy.payloads:
        doc = json.loads(payload)
        assert set(doc) == {"r", "s"}, payload  # sealed: the sender, then ciphertext
        for p in prompts:
            assert p not in payload
    assert a.services.bus.unopened == 0 and b.services.bus.unopened == 0


@pytest.fixture
def buses(pg_url):
    key = AtRestCipher(os.urandom(32))
    made = []

    def bus(replica_id, cipher=key):
        made.append(PgNotifyBus(pg_url, replica_id=replica_id, cipher=cipher))
        return made[-1]
    yield bus
    for b in made:
        b.close()


def _collect(bus, kind):
    got = []
    bus.subscribe(kind, got.append)
    return got


def test_a_wake_up_that_does_not_open_is_a_catch_up_not_a_crash(buses, pg_url, caplog):
    a, stranger, b = buses("a"), buses("x", cipher=AtRestCipher(os.urandom(32))), buses("b")
    gaps = []  # how many had not opened when each catch-up ran
    b.on_gap(lambda: gaps.append(b.unopened))
    got = _collect(b, "job")
    for bus in (a, stranger, b):
        bus.start()
    caplog.set_level(logging.WARNING, logger="broker.storage.notify_pg")
    stranger.publish("job", {"j": "from another key", "e": 1})  # another at-rest key
    with psycopg.connect(conninfo_of(pg_url), autocommit=True) as c:  # forged, plaintext
        c.execute("SELECT pg_notify(%s, %s)",
                  (CHANNEL, json.dumps({"r": "a", "m": [["job", {"j": "forged", "e": 1}]]})))
        sealed = json.loads(a._pack([("job", {"j": "altered"})])[0])
        raw = bytearray(base64.b64decode(sealed["s"]))
        raw[-1] ^= 1
        c.execute("SELECT pg_notify(%s, %s)", (CHANNEL, json.dumps(
            {"r": "a", "s": base64.b64encode(bytes(raw)).decode()})))
        c.execute("SELECT pg_notify(%s, %s)", (CHANNEL, "not json at all"))
    # the replica catches up from the rows: at once for the first, and once more after
    # the last (coalesced: CATCH_UP_EVERY_S apart)
    assert _until(lambda: b.unopened == 4 and gaps and gaps[-1] == 4)
    assert gaps[0] == 1 and len(gaps) <= 4
    a.publish("job", {"j": "after", "e": 1})  # and it still listens
    assert _until(lambda: got == [{"j": "after", "e": 1}])
    assert "cannot read" in caplog.text and "SPARECYCLES_AT_REST_KEY" in caplog.text


def test_a_flood_of_wake_ups_that_do_not_open_costs_few_catch_ups(buses, pg_url):
    """Any role that may NOTIFY can send junk: each payload that does not open would run
    every catch-up handler (wake every waiting client, rescan the queue). They are
    coalesced: at most one every CATCH_UP_EVERY_S, and one after the last."""
    b = buses("b")
    gaps = []  # (when, how many had not opened) for each catch-up
    b.on_gap(lambda: gaps.append((time.monotonic(), b.unopened)))
    got = _collect(b, "job")
    b.start()
    flood = 300
    started = time.monotonic()
    with psycopg.connect(conninfo_of(pg_url), autocommit=True) as c:
        for i in range(flood):
            c.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"junk {i}"))
    assert _until(lambda: b.unopened == flood and gaps and gaps[-1][1] == flood)
    elapsed = gaps[-1][0] - started
    assert len(gaps) <= 2 + elapsed / CATCH_UP_EVERY_S, (len(gaps), elapsed)
    assert len(gaps) < flood
    a = buses("a")  # and it still hears what opens
    a.start()
    a.publish("job", {"j": "after", "e": 1})
    assert _until(lambda: got == [{"j": "after", "e": 1}])


def test_a_sealed_wake_up_too_large_for_notify_goes_without_its_copy(buses, pg_url):
    a, b = buses("a"), buses("b")
    a.pool_size = 0  # through the sender thread's packing (the urgent path is tested below)
    jobs, queued = _collect(b, "job"), _collect(b, "queued")
    spy = Eavesdropper(pg_url)
    a.start(), b.start()
    try:
        big = {"outputs": "z" * 5_900}  # fits a plaintext notification, not a sealed one
        a.publish("job", {"j": "j1", "e": 1, "c": big})
        a.publish("job", {"j": "j2", "e": 1, "c": {"outputs": "small"}})
        a.publish("queued", {"j": ["q" * 36] * 400})  # no copy to leave out: dropped
        a.publish("queued", {"j": ["q1"]})
        assert _until(lambda: len(jobs) == 2 and queued)
    finally:
        spy.close()
    assert jobs == [{"j": "j1", "e": 1}, {"j": "j2", "e": 1, "c": {"outputs": "small"}}]
    assert queued == [{"j": ["q1"]}]
    assert spy.payloads and all(len(p.encode()) <= MAX_PAYLOAD for p in spy.payloads)
    # The same from the publishing thread (an idle connection of the bus's own).
    c = buses("c")
    c.start()
    c.publish("job", {"j": "j3", "e": 1, "c": big})
    c.publish("queued", {"j": ["q" * 36] * 400})
    c.publish("job", {"j": "j4"})
    assert _until(lambda: len(jobs) == 4)
    assert jobs[2:] == [{"j": "j3", "e": 1}, {"j": "j4"}]


# ---- the key check value -----------------------------------------------------------------
def _broker(tmp_path, name, pg_url, **kw):
    return LiveBroker(tmp_path / name, db_url=pg_url, key_path=tmp_path / "broker.key", **kw)


def test_a_replica_with_another_at_rest_key_or_none_is_refused(tmp_path, pg_url):
    key = _key()
    a = _broker(tmp_path, "a", pg_url, at_rest_key=key)
    try:
        with pytest.raises(AtRestMismatch) as other:
            _broker(tmp_path, "b", pg_url, at_rest_key=_key())
        assert "SPARECYCLES_AT_REST_KEY" in str(other.value)
        assert "is not the one this database is sealed with" in str(other.value)
        # None given (no setting, no key file in its data dir): refused, and no new key
        # file is made for it.
        with pytest.raises(AtRestMismatch) as none:
            _broker(tmp_path, "c", pg_url)
        assert "SPARECYCLES_AT_REST_KEY" in str(none.value)
        assert "does not have" in str(none.value)
        assert not (tmp_path / "c" / "broker" / "at_rest.key").exists()
        # The same key: it serves, and reads what the first sealed.
        b = _broker(tmp_path, "b", pg_url, at_rest_key=key)
        try:
            seen_provider(a.services)
            _, who = a.services.auth.create_account_with_key("client")
            a.services.payments.grant(who.account_id, 10**7, by="test")
            job, _ = a.services.jobs.submit(who, job_request({"plugin": "echo",
                                                  "inputs": {"text": "sealed on a"}}, a.services.jobs.catalog))
            assert b.services.jobs.repo.get(job.id).inputs["text"] == "sealed on a"
        finally:
            b.stop()
    finally:
        a.stop()


def test_a_lost_key_file_is_refused_not_replaced(tmp_path):
    """SQLite too: the data dir's at_rest.key deleted (or a backup restored without it)
    used to be replaced by a new key silently, and nothing sealed before read back."""
    settings = Settings(data_dir=tmp_path / "d", verification=False)
    from broker.services import build_services

    build_services(settings).close()
    (tmp_path / "d" / "at_rest.key").unlink()
    with pytest.raises(AtRestMismatch, match="SPARECYCLES_AT_REST_KEY"):
        build_services(settings)
    assert not (tmp_path / "d" / "at_rest.key").exists()


def test_serve_refuses_another_key_with_the_setting_to_fix(tmp_path, pg_url):
    import subprocess
    import sys

    first = _broker(tmp_path, "a", pg_url, at_rest_key=_key())
    first.stop()
    out = subprocess.run(
        [sys.executable, "-m", "sdk.cli", "broker", "serve", "--data-dir", str(tmp_path / "b"),
         "--db", pg_url, "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "SPARECYCLES_AT_REST_KEY": _key()})
    assert out.returncode != 0
    assert "error:" in out.stderr and "SPARECYCLES_AT_REST_KEY" in out.stderr
    assert "Traceback" not in out.stderr


def _forget_check(engine):
    """The database as a broker from before the check value left it (sealed rows, no
    recorded key)."""
    from broker.storage.models import AtRestKeyCheckRow

    with engine.begin() as c:
        c.execute(AtRestKeyCheckRow.__table__.delete())


def test_seal_at_rest_records_the_check_value_and_refuses_another_key(tmp_path, pg_url,
                                                                       capsys, monkeypatch):
    from broker.services import build_services
    from broker.storage.sealed import recorded_key_check
    from sdk.cli import main

    key = _key()
    settings = Settings(data_dir=tmp_path / "d", db_url=pg_url, at_rest_key=key,
                        verification=False)
    svc = build_services(settings)
    seen_provider(svc, ["echo"])
    _, who = svc.auth.create_account_with_key("client")
    svc.payments.grant(who.account_id, 10**7, by="test")
    svc.jobs.submit(who, job_request({"plugin": "echo",
                                      "inputs": {"text": "sealed by the first key"}},
                                     svc.jobs.catalog))
    _forget_check(svc.engine)
    svc.close()

    # not the key those jobs are sealed with: refused before anything is rewritten
    monkeypatch.setenv("SPARECYCLES_AT_REST_KEY", _key())
    with pytest.raises(SystemExit) as refused:
        main(["broker", "seal-at-rest", "--data-dir", str(tmp_path / "d"), "--db", pg_url])
    assert "sealed with another at-rest key" in str(refused.value)
    assert "SPARECYCLES_AT_REST_KEY" in str(refused.value)
    monkeypatch.setenv("SPARECYCLES_AT_REST_KEY", key)
    assert main(["broker", "seal-at-rest", "--data-dir", str(tmp_path / "d"),
                 "--db", pg_url]) == 0
    check = AtRestCipher(base64.b64decode(key)).check_value
    assert check[:12] in capsys.readouterr().out
    from broker.storage.base import make_engine

    engine = make_engine(pg_url)
    try:
        assert recorded_key_check(engine) == check
        assert key not in check and base64.b64decode(key).hex() not in check
    finally:
        engine.dispose()


def test_seal_existing_records_the_check_value_of_its_engine(tmp_path):
    from broker.blobs.local import LocalBlobStore
    from broker.storage.base import make_engine
    from broker.storage.migrate import upgrade
    from broker.storage.sealed import attach, recorded_key_check, seal_existing

    engine = make_engine(f"sqlite:///{tmp_path / 'b.db'}")
    upgrade(engine)
    cipher = AtRestCipher(os.urandom(32))
    attach(engine, cipher)
    assert recorded_key_check(engine) is None
    seal_existing(engine, LocalBlobStore(tmp_path / "blobs"))
    assert recorded_key_check(engine) == cipher.check_value
    other = make_engine(f"sqlite:///{tmp_path / 'b.db'}")
    attach(other, AtRestCipher(os.urandom(32)))
    with pytest.raises(AtRestMismatch):
        seal_existing(other, LocalBlobStore(tmp_path / "blobs"))
    other.dispose()
    engine.dispose()


def _broker_cli(*argv) -> int:
    from sdk import cli

    return cli.main(["broker", *[str(a) for a in argv]])


def test_an_admin_command_without_the_key_does_not_record_one_it_made(tmp_path, pg_url,
                                                                      monkeypatch, capsys):
    """infra/README.md's one-off `create-key` in a throwaway container (no at-rest key, a
    data dir that is gone afterwards) on a fresh database: the key file it makes for itself
    is not recorded, so the replicas that then serve with the shared key are not refused."""
    from sqlalchemy import create_engine

    from broker.storage.sealed import recorded_key_check

    monkeypatch.delenv("SPARECYCLES_AT_REST_KEY", raising=False)
    throwaway = tmp_path / "container"
    assert _broker_cli("migrate", "--data-dir", throwaway, "--db", pg_url) == 0
    assert _broker_cli("create-key", "--data-dir", throwaway, "--db", pg_url,
                       "--role", "admin", "--name", "ops") == 0
    engine = create_engine(pg_url)
    try:
        assert recorded_key_check(engine) is None
        key = _key()
        a = _broker(tmp_path, "a", pg_url, at_rest_key=key)  # serves, and records its key
        try:
            assert recorded_key_check(engine) == AtRestCipher(base64.b64decode(key)).check_value
        finally:
            a.stop()
    finally:
        engine.dispose()


def test_a_refused_broker_leaves_no_key_file_of_its_own(tmp_path, pg_url):
    """A database sealed before it recorded its key (no check value), started by a broker
    with no key: refused, and the random key file made for it is gone (the error says to
    copy the right key to that path)."""
    from sqlalchemy import create_engine, delete

    from broker.storage.models import AtRestKeyCheckRow

    a = _broker(tmp_path, "a", pg_url, at_rest_key=_key())
    try:
        seen_provider(a.services)
        _, who = a.services.auth.create_account_with_key("client")
        a.services.payments.grant(who.account_id, 10**7, by="test")
        a.services.jobs.submit(who, job_request({"plugin": "echo",
                                                 "inputs": {"text": "sealed on a"}},
                                                a.services.jobs.catalog))
    finally:
        a.stop()
    engine = create_engine(pg_url)
    with engine.begin() as c:
        c.execute(delete(AtRestKeyCheckRow.__table__))
    engine.dispose()
    with pytest.raises(AtRestMismatch) as exc:
        _broker(tmp_path, "c", pg_url)
    assert "sealed with another at-rest key" in str(exc.value)
    assert not (tmp_path / "c" / "broker" / "at_rest.key").exists()


def test_a_damaged_sealed_value_is_a_clean_refusal_not_a_traceback(tmp_path, pg_url):
    """The newest sealed inputs are checked against the key before it is recorded; one that
    is not even base64 (a damaged row) is refused saying which job, and why."""
    from sqlalchemy import JSON, create_engine, delete, type_coerce, update

    from broker.storage.models import AtRestKeyCheckRow, JobRow
    from broker.storage.sealed import AtRestError

    a = _broker(tmp_path, "a", pg_url, at_rest_key=_key())
    try:
        seen_provider(a.services)
        _, who = a.services.auth.create_account_with_key("client")
        a.services.payments.grant(who.account_id, 10**7, by="test")
        job, _ = a.services.jobs.submit(who, job_request(
            {"plugin": "echo", "inputs": {"text": "x"}}, a.services.jobs.catalog))
    finally:
        a.stop()
    engine = create_engine(pg_url)
    jobs = JobRow.__table__
    with engine.begin() as c:
        c.execute(delete(AtRestKeyCheckRow.__table__))
        c.execute(update(jobs).where(jobs.c.id == job.id).values(
            inputs=type_coerce({"$sealed": "not*base64!"}, JSON)))
    engine.dispose()
    with pytest.raises(AtRestError) as exc:
        _broker(tmp_path, "c", pg_url, at_rest_key=_key())
    assert job.id in str(exc.value) and "not base64" in str(exc.value)


def test_seal_at_rest_without_a_key_is_refused_and_makes_none(tmp_path, capsys, monkeypatch):
    """No key set and no key file in the data dir: sealing would make a key for this
    command alone (gone with a one-off container) and seal everything with it."""
    from sdk.cli import main

    monkeypatch.delenv("SPARECYCLES_AT_REST_KEY", raising=False)
    data = tmp_path / "d"
    assert main(["broker", "seal-at-rest", "--data-dir", str(data)]) == 2
    err = capsys.readouterr().err
    assert "SPARECYCLES_AT_REST_KEY" in err and "at_rest.key" in err
    assert not (data / "at_rest.key").exists()
