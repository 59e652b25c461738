"""What replicas store is sealed with one at-rest key (issues #21, #23): the database
records which key it is sealed with, so a replica with another key (or none) is refused at
start instead of writing what the others cannot read."""
from __future__ import annotations

import base64
import os

import pytest

from broker.settings import Settings
from broker.storage.sealed import AtRestCipher, AtRestMismatch

from tests.integration.conftest import LiveBroker, seen_provider


def _key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


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
            job, _ = a.services.jobs.submit(who, {"plugin": "echo",
                                                  "inputs": {"text": "sealed on a"}})
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
    svc.jobs.submit(who, {"plugin": "echo", "inputs": {"text": "sealed by the first key"}})
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
