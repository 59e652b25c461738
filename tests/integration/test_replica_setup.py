"""What replicas need before they serve (issue #21): the schema migrated once, under a
lock, by `sparecycles broker migrate`; `serve` refusing a PostgreSQL database that is
behind, saying what to run; one signing key shared by all (a replica with another is
refused); and one broker process per SQLite file."""
from __future__ import annotations

import base64
import os
import subprocess
import sys
import threading
import time

import pytest
from sqlalchemy import create_engine

from broker.replicas.service import ReplicaMismatch
from broker.server import BrokerServer
from broker.settings import Settings
from broker.storage.lock import DatabaseInUse
from broker.storage.migrate import NotMigrated, current, heads, upgrade
from sdk.protocol.signing import KeyPair

from tests.integration.conftest import LiveBroker


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "sdk.cli", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_serve_refuses_an_unmigrated_postgres_until_migrate_runs(tmp_path, pg_url):
    settings = Settings(data_dir=tmp_path / "d", db_url=pg_url, http="127.0.0.1:0",
                        grpc="127.0.0.1:0")
    with pytest.raises(NotMigrated) as exc:
        BrokerServer(settings, migrate="auto")
    assert "sparecycles broker migrate" in str(exc.value)
    assert "never migrated" in str(exc.value)
    out = _cli("broker", "migrate", "--data-dir", str(tmp_path / "d"), "--db", pg_url)
    assert out.returncode == 0, out.stderr
    assert "migrated" in out.stdout and min(heads()) in out.stdout
    again = _cli("broker", "migrate", "--data-dir", str(tmp_path / "d"), "--db", pg_url)
    assert again.returncode == 0 and "up to date" in again.stdout
    server = BrokerServer(settings, migrate="auto")  # now it serves
    server.stop()


def test_migrations_run_at_once_take_turns_under_the_advisory_lock(pg_url):
    engine = create_engine(pg_url)
    errors = []

    def run():
        try:
            upgrade(engine)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and current(engine) == heads()
    engine.dispose()


def test_a_second_broker_on_the_same_sqlite_file_is_refused(tmp_path):
    settings = Settings(data_dir=tmp_path / "d", http="127.0.0.1:0", grpc="127.0.0.1:0",
                        verification=False)
    first = BrokerServer(settings)
    try:
        with pytest.raises(DatabaseInUse) as exc:
            BrokerServer(settings)
        assert "SQLite is for one broker process" in str(exc.value)
        assert str(os.getpid()) in str(exc.value)
    finally:
        first.stop()
    BrokerServer(settings).stop()  # free again once the first stopped


def test_a_replica_with_another_signing_key_is_refused(tmp_path, pg_url):
    at_rest = {"at_rest_key": base64.b64encode(os.urandom(32)).decode()}  # shared (and checked)
    a = LiveBroker(tmp_path / "a", db_url=pg_url, **at_rest)
    try:
        with pytest.raises(ReplicaMismatch) as exc:
            LiveBroker(tmp_path / "b", db_url=pg_url, **at_rest)
        assert "SPARECYCLES_BROKER_SIGNING_KEY" in str(exc.value)
        seed = KeyPair.load(a.settings.key_path).seed_hex
        b = LiveBroker(tmp_path / "c", db_url=pg_url, signing_key=seed,
                       **at_rest)  # the same key: fine
        assert b.services.signer.public_key_hex == a.services.signer.public_key_hex
        b.stop()
    finally:
        a.stop()


def test_signing_key_and_console_secret_come_from_the_environment(tmp_path):
    seed = KeyPair.generate().seed_hex
    s = Settings.from_env({"SPARECYCLES_BROKER_SIGNING_KEY": seed,
                           "SPARECYCLES_ADMIN_SESSION_KEY": str(tmp_path / "console.key")},
                          data_dir=tmp_path)
    assert s.signer().seed_hex == seed
    assert not s.key_path.exists()  # no key file written
    assert s.admin_session_key_path == tmp_path / "console.key"
    with pytest.raises(ValueError, match="64 hex"):
        Settings(data_dir=tmp_path, signing_key="nothex")


def test_theta_reliability_and_the_last_canary_survive_a_restart(tmp_path):
    from tests.integration.conftest import agent_starter

    first = LiveBroker(tmp_path)
    start, stop_all = agent_starter(first)
    try:
        agent = start("a1")
        market = first.services.market
        deadline = time.monotonic() + 20
        while not market.theta(agent.provider_id, "echo")[1]:
            assert time.monotonic() < deadline, "never measured"
            time.sleep(0.05)
        theta = market.theta(agent.provider_id, "echo")
        pid = agent.provider_id
    finally:
        stop_all()
        first.stop()
    second = LiveBroker(tmp_path)  # the same data dir and database
    try:
        market = second.services.market
        assert market.theta(pid, "echo") == pytest.approx(theta)  # not cold again
        from broker.jobs.presence import AgentSession
        sent = []

        class Agent(AgentSession):
            def send_assignment(self, envelope_bytes, signature):
                sent.append(envelope_bytes)

        market.presence.add(Agent(provider_id=pid, public_key="", account_id="op",
                                  plugins={"echo@1.0.0": ""}))  # it connects again
        assert market.canaries_due(pid) == [] and sent == []  # its canary ran moments ago
    finally:
        second.stop()
