"""The benchmark's statement and COMMIT counts (broker/storage/counting.py): off unless
asked for, and counting what reaches SQLite, prepared statements and COMMITs included."""
import pytest
from sqlalchemy import text

from broker.storage import counting
from broker.storage.base import atomic, begin, make_engine


def test_counting_is_off_unless_asked_and_refuses_a_bad_value(monkeypatch):
    monkeypatch.delenv(counting.ENV, raising=False)
    assert not counting.enabled()
    monkeypatch.setenv(counting.ENV, "maybe")
    with pytest.raises(ValueError, match=counting.ENV):
        counting.enabled()


def test_sqlite_statements_and_commits_are_counted(monkeypatch, tmp_path):
    monkeypatch.setenv(counting.ENV, "1")
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    try:
        with engine.begin() as c:
            c.execute(text("CREATE TABLE t (x INTEGER)"))
        s0, c0 = counting.COUNTS.statements, counting.COUNTS.commits
        with atomic(engine):
            for i in range(3):
                with begin(engine) as c:
                    c.execute(text("INSERT INTO t VALUES (:x)"), {"x": i})
        assert counting.COUNTS.commits - c0 == 1  # one transaction
        # three inserts, each in a savepoint (two statements), BEGIN, the group's own
        # savepoint (two) and COMMIT
        assert counting.COUNTS.statements - s0 >= 3 + 3 * 2 + 2
    finally:
        engine.dispose()


def test_flat_writes_in_an_atomic_block_open_no_savepoint_and_a_failure_undoes_the_block(
        monkeypatch, tmp_path):
    from broker.storage.base import flat
    monkeypatch.setenv(counting.ENV, "1")
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    try:
        with engine.begin() as c:
            c.execute(text("CREATE TABLE t (x INTEGER UNIQUE)"))

        def three(flat_writes):
            s0 = counting.COUNTS.statements
            with atomic(engine):
                for i in range(3):
                    with (flat(engine) if flat_writes else _nothing()):
                        with begin(engine) as c:
                            c.execute(text("INSERT INTO t VALUES (:x)"),
                                      {"x": i + 10 * flat_writes})
            return counting.COUNTS.statements - s0
        assert three(False) - three(True) == 3 * 2  # a SAVEPOINT and its RELEASE each
        with pytest.raises(Exception):
            with atomic(engine):
                with begin(engine) as c:
                    c.execute(text("INSERT INTO t VALUES (100)"))
                with flat(engine), begin(engine) as c:
                    c.execute(text("INSERT INTO t VALUES (0)"))  # taken: the block fails
        with engine.connect() as c:
            assert c.execute(text("SELECT count(*) FROM t WHERE x = 100")).scalar() == 0
    finally:
        engine.dispose()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
