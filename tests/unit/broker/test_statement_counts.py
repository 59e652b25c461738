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
