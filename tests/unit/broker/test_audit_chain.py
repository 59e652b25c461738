"""The audit chain (in memory and SQL): appends link by hash, verification finds the first
broken link, money movements are audited once per ledger transaction."""
from __future__ import annotations

import pytest
from sqlalchemy.orm import sessionmaker

from broker.audit.service import AuditLog, InMemoryAuditRepository
from broker.storage.admin_sql import SqlAuditRepository
from broker.storage.base import make_engine
from broker.storage.migrate import upgrade


@pytest.fixture(params=["memory", "sqlite"])
def log(request, tmp_path):
    if request.param == "memory":
        return AuditLog(InMemoryAuditRepository(), clock=lambda: 1000.0)
    engine = make_engine(f"sqlite:///{tmp_path / 'a.db'}")
    upgrade(engine)
    log = AuditLog(SqlAuditRepository(sessionmaker(engine, expire_on_commit=False)),
                   clock=lambda: 1000.0)
    log.engine = engine
    return log


def test_chain_links_and_verifies(log):
    for i in range(5):
        log.record("admin:a", "pricing.set", "plugin:echo", {"before": i, "after": i + 1})
    report = log.verify()
    assert report.ok and report.checked == 5
    entries = sorted(log.search(limit=10), key=lambda e: e.seq)
    assert [e.seq for e in entries] == [1, 2, 3, 4, 5]
    assert all(b.prev_hash == a.hash for a, b in zip(entries, entries[1:]))


def test_ref_deduplicates_replays(log):
    assert log.record("ledger", "ledger.post", "hold:h", {"x": 1}, ref="txn:1") is not None
    assert log.record("ledger", "ledger.post", "hold:h", {"x": 1}, ref="txn:1") is None
    assert len(log.search(limit=10)) == 1


def test_tampered_row_is_pointed_at(log):
    for i in range(4):
        log.record("admin:a", "provider.pause", f"provider:{i}", {"reason": f"r{i}"})
    if hasattr(log, "engine"):
        with log.engine.begin() as c:
            c.exec_driver_sql("UPDATE audit_log SET data = '{\"reason\":\"edited\"}' WHERE seq = 3")
    else:
        from dataclasses import replace
        repo = log.repo
        repo.entries[2] = replace(repo.entries[2], data={"reason": "edited"})
    report = log.verify()
    assert not report.ok and report.broken_seq == 3 and report.checked == 2
    assert "changed after it was written" in report.problem


def test_deleted_row_is_pointed_at(tmp_path):
    repo = InMemoryAuditRepository()
    log = AuditLog(repo)
    for i in range(3):
        log.record("system", "x", "y", {"i": i})
    del repo.entries[1]
    report = log.verify()
    assert not report.ok and report.broken_seq == 2 and "missing" in report.problem


def test_money_movements_are_audited_once(tmp_path):
    from broker.audit.money import AuditedLedger
    from broker.ledger.service import LedgerService
    from broker.storage.ledger_sql import SqlLedgerRepository

    engine = make_engine(f"sqlite:///{tmp_path / 'l.db'}")
    upgrade(engine)
    audit = AuditLog(InMemoryAuditRepository())
    ledger = AuditedLedger(LedgerService(SqlLedgerRepository(engine)), audit)
    ledger.open_platform_accounts()
    ledger.open_client("c1")
    from broker.ledger.model import FundingSource
    for _ in range(2):  # an idempotent replay writes no second entry
        ledger.deposit("c1", 5_000_000, idempotency_key="k1", source=FundingSource.DEV_GRANT)
    ledger.hold("c1", 1_000_000, "job-1", idempotency_key="h1")
    actions = [e.action for e in sorted(audit.search(limit=10), key=lambda e: e.seq)]
    assert actions == ["ledger.deposit", "ledger.hold"]
    assert audit.verify().ok


def test_two_writers_on_one_log_keep_one_chain(log):
    """Each AuditLog keeps its head in memory; a second writer (another broker replica)
    makes it stale, which the next append finds out (SeqTaken) and recovers from."""
    other = AuditLog(log.repo, clock=lambda: 1000.0)
    for i in range(3):
        assert log.record("system", "x", "y", {"i": i}) is not None
        assert other.record("system", "x", "y", {"j": i}) is not None
    # A replay through the writer whose head is stale is still recognised by its ref.
    assert other.record("ledger", "ledger.post", "hold:h", {}, ref="txn:9") is not None
    assert log.record("ledger", "ledger.post", "hold:h", {}, ref="txn:9") is None
    assert log.record("system", "x", "y", {"k": 1}) is not None
    entries = sorted(log.search(limit=20), key=lambda e: e.seq)
    assert [e.seq for e in entries] == list(range(1, 9))
    report = log.verify()
    assert report.ok and report.checked == 8


def test_an_entry_hashed_before_canonical_json_became_jcs_still_verifies():
    """Old chains hold entries hashed with plain sorted-key JSON (1.0, not JCS's 1): they
    still verify, and a changed one is still caught."""
    import hashlib
    from dataclasses import replace

    from broker.audit.model import GENESIS, AuditEntry
    from sdk.protocol.canonical import canonical_bytes, legacy_bytes

    entry = AuditEntry(seq=1, at_ms=5, actor="system", action="pricing.set",
                       subject="plugin:echo", data={"fee": 1.0, "tiny": 1e-7})
    doc = entry.document()
    assert legacy_bytes(doc) != canonical_bytes(doc)
    old = replace(entry, hash=hashlib.sha256(GENESIS.encode() + legacy_bytes(doc)).hexdigest())
    assert old.compute_hash() != old.hash and old.hashes_as_written()
    assert not replace(old, data={"fee": 2.0, "tiny": 1e-7}).hashes_as_written()
    assert replace(entry, hash=entry.compute_hash()).hashes_as_written()


def _sql_log(db_url):
    engine = make_engine(db_url)
    upgrade(engine)
    return AuditLog(SqlAuditRepository(sessionmaker(engine, expire_on_commit=False)),
                    clock=lambda: 1000.0), engine


def test_the_entries_of_one_transaction_are_appended_together_or_one_at_a_time(db_url):
    """Several entries deferred to one COMMIT (a receipt batch's posts) go in as one
    chained multi-row INSERT; when a seq of it is taken (another writer appended, the head
    is stale) or a ref is (a replay), nothing of it stays and they go one at a time."""
    log, engine = _sql_log(db_url)
    other = AuditLog(log.repo, clock=lambda: 1000.0)
    try:
        with log.repo.transaction():
            for i in range(4):
                log.record("ledger", "ledger.post", f"hold:{i}", {"i": i}, ref=f"txn:{i}")
        assert [e.seq for e in sorted(log.search(limit=20), key=lambda e: e.seq)] == [1, 2, 3, 4]
        other.record("system", "x", "y", {"other": 1})  # log's head is stale now
        with log.repo.transaction():
            for i in range(3, 7):  # txn:3 is a replay: skipped, the rest appended
                log.record("ledger", "ledger.post", f"hold:{i}", {"i": i}, ref=f"txn:{i}")
        with log.repo.transaction():  # the head is known again: together
            for i in range(7, 9):
                log.record("ledger", "ledger.post", f"hold:{i}", {"i": i}, ref=f"txn:{i}")
        entries = sorted(log.search(limit=20), key=lambda e: e.seq)
        assert [e.seq for e in entries] == list(range(1, 11))
        assert [e.ref for e in entries].count("txn:3") == 1
        report = log.verify()
        assert report.ok and report.checked == 10
    finally:
        engine.dispose()
