"""One transaction across repositories (broker.storage.base.atomic), on SQLite and
PostgreSQL: a step inside that fails undoes only itself (a savepoint), a block that fails
undoes everything including its audit entries, and the audit chain's head moves only
with a commit. On SQLite, transactions that wait for the writer share one COMMIT (group
commit), and a failed one still undoes only itself."""
from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import sessionmaker

from broker.audit.service import AuditLog
from broker.storage.admin_sql import SqlAuditRepository
from broker.storage.base import atomic, begin, make_engine
from broker.storage.migrate import upgrade


@pytest.fixture
def engine(db_url):
    engine = make_engine(db_url)
    upgrade(engine)
    with engine.begin() as c:
        c.execute(text("CREATE TABLE t (a INTEGER)"))
    yield engine
    engine.dispose()


def _rows(engine) -> list[int]:
    with engine.connect() as c:
        return [r[0] for r in c.execute(text("SELECT a FROM t ORDER BY a"))]


def _insert(conn, a: int) -> None:
    conn.execute(text("INSERT INTO t (a) VALUES (:a)"), {"a": a})


def test_steps_commit_together(engine):
    with atomic(engine):
        for a in (1, 2):
            with begin(engine) as c:
                _insert(c, a)
        assert _rows(engine) == []  # nothing is visible before the block commits
    assert _rows(engine) == [1, 2]


def test_a_failed_step_undoes_only_itself(engine):
    with atomic(engine):
        with begin(engine) as c:
            _insert(c, 1)
        with pytest.raises(RuntimeError):
            with begin(engine) as c:
                _insert(c, 2)
                raise RuntimeError("refused after writing")
        with begin(engine) as c:  # the transaction goes on (on PostgreSQL too)
            _insert(c, 3)
    assert _rows(engine) == [1, 3]


def test_a_failed_block_undoes_everything_and_runs_its_rollback_hooks(engine):
    ran = []
    with pytest.raises(RuntimeError):
        with atomic(engine) as tx:
            tx.after_commit(lambda: ran.append("commit"))
            tx.after_rollback(lambda: ran.append("rollback"))
            with begin(engine) as c:
                _insert(c, 1)
            raise RuntimeError("boom")
    assert _rows(engine) == [] and ran == ["rollback"]
    with atomic(engine) as tx:
        tx.after_commit(lambda: ran.append("commit"))
    assert ran == ["rollback", "commit"]


def test_audit_entries_commit_with_their_block_and_the_chain_stays_whole(engine):
    log = AuditLog(SqlAuditRepository(sessionmaker(engine)))
    assert log.record("system", "a", "s") is not None
    with pytest.raises(RuntimeError):
        with atomic(engine):
            with begin(engine) as c:
                _insert(c, 1)
            assert log.record("ledger", "ledger.hold", "job:x", ref="txn:1") is None  # deferred
            raise RuntimeError("the job insert failed")
    assert [e.action for e in log.search(limit=10)] == ["a"]  # the entry went with its block
    with atomic(engine):
        log.record("ledger", "ledger.hold", "job:y", ref="txn:2")
        with pytest.raises(RuntimeError):
            with begin(engine):
                log.record("ledger", "ledger.post", "job:y", ref="txn:3")
                raise RuntimeError("the post failed: its entry is dropped with it")
    entries = sorted(log.search(limit=10), key=lambda e: e.seq)
    assert [(e.seq, e.action) for e in entries] == [(1, "a"), (2, "ledger.hold")]
    assert log.record("system", "b", "s").seq == 3
    assert log.verify().ok


def test_on_sqlite_another_connection_inside_a_block_reads_but_cannot_write(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'w.db'}")  # the writer lock is SQLite's
    with engine.begin() as c:
        c.execute(text("CREATE TABLE t (a INTEGER)"))
        _insert(c, 1)
    with atomic(engine):
        with engine.begin() as other:  # would wait forever on the writer lock
            assert other.execute(text("SELECT count(*) FROM t")).scalar() == 1
            with pytest.raises(OperationalError, match="readonly"):
                _insert(other, 2)
    with engine.begin() as c:  # the connection went back to the pool writable
        _insert(c, 3)
    assert _rows(engine) == [1, 3]
    engine.dispose()


def test_a_read_inside_a_block_uses_the_block_connection(engine):
    """read_only() inside an atomic block sees what the block wrote so far and takes no
    second connection from the pool."""
    from broker.storage.base import read_only

    with atomic(engine) as tx:
        with begin(engine) as c:
            _insert(c, 7)
        with read_only(engine) as r:
            assert r is tx.conn
            assert [row[0] for row in r.execute(text("SELECT a FROM t"))] == [7]
    with read_only(engine) as r:  # outside a block: not the block's (it has ended)
        assert r.execute(text("SELECT count(*) FROM t")).scalar() == 1
    assert _rows(engine) == [7]


def test_on_sqlite_threads_queued_on_the_writer_never_starve_its_holder(tmp_path):
    """More threads wait for the writer lock, each holding a pooled connection, than a
    capped pool has: the holder still gets the connection it needs for a read (it used to
    wait out the pool's 30 s timeout and fail)."""
    import threading

    engine = make_engine(f"sqlite:///{tmp_path / 'p.db'}")
    with engine.begin() as c:
        c.execute(text("CREATE TABLE t (a INTEGER)"))
    waiters = 24  # SQLAlchemy's default cap is 5 + 10 overflow
    holding, done = threading.Event(), []

    def writer(a):
        holding.wait()
        with engine.begin() as c:  # a connection from the pool, then the writer lock
            _insert(c, a)
        done.append(a)

    threads = [threading.Thread(target=writer, args=(a,)) for a in range(waiters)]
    for t in threads:
        t.start()
    with atomic(engine):
        holding.set()
        import time
        time.sleep(0.5)  # the writers take their connections and queue on the lock
        with engine.connect() as other:  # the holder's own read on a fresh connection
            assert other.execute(text("SELECT count(*) FROM t")).scalar() == 0
    for t in threads:
        t.join(30)
    assert sorted(done) == list(range(waiters))
    engine.dispose()


def test_on_sqlite_writes_share_one_connection_and_reads_keep_their_own(tmp_path):
    """Every thread's writes run on the engine's one writer connection (its page cache
    stays valid); each thread reuses its own reader; a broken one is replaced; dispose
    closes them all."""
    import threading

    from broker.storage.base import read_only

    engine = make_engine(f"sqlite:///{tmp_path / 'w.db'}")
    with engine.begin() as c:
        c.execute(text("CREATE TABLE t (a INTEGER)"))
    seen = {}

    def work(name, a):
        with begin(engine) as w:
            _insert(w, a)
        with atomic(engine) as tx:
            with begin(engine) as w:
                _insert(w, a + 100)
        readers = []
        for _ in range(2):
            with read_only(engine) as r:
                readers.append(r)
                r.execute(text("SELECT count(*) FROM t")).scalar()
        seen[name] = (w.connection.dbapi_connection, tx.conn.connection.dbapi_connection,
                      readers)

    threads = [threading.Thread(target=work, args=(i, i)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    writers = {id(x) for v in seen.values() for x in v[:2]}
    assert len(writers) == 1  # one writer connection for all threads and both paths
    for _, _, readers in seen.values():
        assert readers[0] is readers[1]  # kept between reads
        assert readers[0].closed  # and closed when its thread ended
    assert len({id(v[2][0]) for v in seen.values()}) == 3  # one reader per thread
    assert _rows(engine) == [0, 1, 2, 100, 101, 102]

    with read_only(engine) as r:
        r.invalidate()  # a connection the driver lost
    with read_only(engine) as r2:
        assert r2 is not r and r2.execute(text("SELECT count(*) FROM t")).scalar() == 6
    with pytest.raises(RuntimeError):
        with begin(engine) as w:
            w.invalidate()  # lost in the middle of a transaction
            raise RuntimeError("the connection is gone")
    with begin(engine) as w2:  # the writer is replaced too
        assert w2 is not w
        _insert(w2, 7)
    assert 7 in _rows(engine)
    engine.dispose()
    assert r2.closed and w2.closed


# ---- SQLite's group commit (broker.storage.base._Writer) --------------------------------
def _grouped(tmp_path):
    """An SQLite engine with table t, and a list that collects its writer's COMMITs."""
    engine = make_engine(f"sqlite:///{tmp_path / 'g.db'}")
    with begin(engine) as c:
        c.execute(text("CREATE TABLE t (a INTEGER)"))
        # Checked at COMMIT: a row without its parent makes the COMMIT itself fail.
        c.execute(text("CREATE TABLE parent (id INTEGER PRIMARY KEY)"))
        c.execute(text("CREATE TABLE child (pid INTEGER REFERENCES parent (id) "
                       "DEFERRABLE INITIALLY DEFERRED)"))
    commits: list[str] = []
    raw = engine._sc_writer.connection().connection.dbapi_connection
    raw.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    return engine, commits


def _in_one_group(engine, first, *later):
    """Run ``first`` in a transaction that waits, with the writer's turn held, until every
    one of ``later`` waits for its turn; each runs ``fn(c)`` in an atomic block on its own
    thread. Returns, by function, what it returned or raised; ``out["first saw"]``: the
    rows another connection read as soon as ``first``'s block returned."""
    import threading
    import time

    writer, gate, out = engine._sc_writer, threading.Event(), {}

    def run(fn, hold=False):
        try:
            with atomic(engine) as tx:
                result = fn(tx.conn)
                if hold:
                    gate.wait(10)
            out[fn] = result
            if hold:
                out["first saw"] = _rows(engine)
        except Exception as error:  # noqa: BLE001 - what the test looks at
            out[fn] = error

    threads = [threading.Thread(target=run, args=(first, True))]
    threads[0].start()
    deadline = time.monotonic() + 10
    while writer.group is None and time.monotonic() < deadline:
        time.sleep(0.001)
    for fn in later:
        threads.append(threading.Thread(target=run, args=(fn,)))
        threads[-1].start()
    while writer.waiting < len(later) and time.monotonic() < deadline:
        time.sleep(0.001)
    gate.set()
    for t in threads:
        t.join(10)
    return out


def test_on_sqlite_transactions_waiting_for_the_writer_share_one_commit(tmp_path):
    """The body that holds the writer, finding others waiting, leaves its work uncommitted
    for the next: three transactions, one COMMIT, and none returns before it."""
    engine, commits = _grouped(tmp_path)

    def first(c):
        _insert(c, 1)

    def second(c):
        _insert(c, 2)
        return {r[0] for r in c.execute(text("SELECT a FROM t"))}

    def third(c):
        _insert(c, 3)

    out = _in_one_group(engine, first, second, third)
    assert {1, 2} <= out[second]  # the first one's row, uncommitted, and its own
    assert commits == ["COMMIT"]
    assert out["first saw"] == [1, 2, 3]  # it returned once the group had committed
    assert _rows(engine) == [1, 2, 3]
    engine.dispose()


def test_on_sqlite_a_failed_transaction_in_a_group_undoes_only_itself(tmp_path):
    engine, commits = _grouped(tmp_path)

    def failing(c):
        _insert(c, 2)
        raise RuntimeError("refused after writing")

    out = _in_one_group(engine, lambda c: _insert(c, 1), failing, lambda c: _insert(c, 3))
    assert isinstance(out[failing], RuntimeError) and commits == ["COMMIT"]
    assert _rows(engine) == [1, 3]
    engine.dispose()


def test_on_sqlite_a_failed_group_commit_fails_every_member_and_writes_nothing(tmp_path):
    """A COMMIT that fails takes every transaction of its group with it: each one's block
    raises and runs its rollback hooks, the audit log reads its head again (its entries
    were never committed), and the next transaction starts afresh."""
    from broker.storage.base import GroupCommitFailed

    engine, _ = _grouped(tmp_path)
    upgrade(engine)
    log = AuditLog(SqlAuditRepository(sessionmaker(engine)))
    log.record("system", "before", "s")
    hooks = []

    def audited(c):
        with atomic(engine) as tx:  # joins this thread's block
            tx.after_rollback(lambda: hooks.append("rolled back"))
            log.record("ledger", "ledger.hold", "job:x", ref="txn:x")
            _insert(c, 1)

    def orphan(c):
        c.execute(text("INSERT INTO child (pid) VALUES (99)"))  # no parent 99

    out = _in_one_group(engine, audited, orphan)
    assert isinstance(out[audited], GroupCommitFailed)
    assert isinstance(out[orphan], GroupCommitFailed)
    assert "FOREIGN KEY" in str(out[orphan])
    assert _rows(engine) == [] and hooks == ["rolled back"]
    after = log.record("system", "after", "s")  # chained to "before", not to the lost one
    assert after.seq == 2 and log.verify().ok
    with begin(engine) as c:
        _insert(c, 5)
    assert _rows(engine) == [5]
    engine.dispose()


def test_on_sqlite_a_new_database_gets_small_pages_and_an_old_one_keeps_its_own(tmp_path):
    # Small pages: every COMMIT writes each page it changed whole (see SQLITE_PAGE_SIZE).
    import sqlite3

    from broker.storage.base import SQLITE_PAGE_SIZE

    engine = make_engine(f"sqlite:///{tmp_path / 'new.db'}")
    upgrade(engine)
    engine.dispose()
    with sqlite3.connect(tmp_path / "new.db") as raw:
        assert raw.execute("PRAGMA page_size").fetchone()[0] == SQLITE_PAGE_SIZE == 1024
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"

    # A database made before (SQLite's default 4096) opens, migrates and writes as it is.
    with sqlite3.connect(tmp_path / "old.db") as raw:
        raw.execute("PRAGMA page_size=4096")
        raw.execute("CREATE TABLE t (a INTEGER)")
    engine = make_engine(f"sqlite:///{tmp_path / 'old.db'}")
    upgrade(engine)
    with atomic(engine):
        with begin(engine) as c:
            _insert(c, 1)
    assert _rows(engine) == [1]
    engine.dispose()
    with sqlite3.connect(tmp_path / "old.db") as raw:
        assert raw.execute("PRAGMA page_size").fetchone()[0] == 4096
