"""Prepared statements (broker/storage/fast.py) give what Connection.execute gives, on
SQLite and PostgreSQL: processed values both ways, expanding IN lists, errors."""
import datetime as dt

import pytest
from sqlalchemy import (JSON, Column, DateTime, Integer, MetaData, String, Table,
                        TypeDecorator, bindparam, exc, insert, select, update)

from broker.storage.base import make_engine
from broker.storage.fast import Prepared


class Upper(TypeDecorator):
    """A type with a bind processor: what is stored is upper case."""
    impl = String(40)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        return None if value is None else value.upper()


META = MetaData()
T = Table("fast_t", META, Column("id", Integer, primary_key=True),
          Column("name", Upper), Column("doc", JSON),
          Column("at", DateTime(timezone=True)))


@pytest.fixture
def engine(db_url):
    engine = make_engine(db_url)
    META.drop_all(engine)
    META.create_all(engine)
    yield engine
    META.drop_all(engine)
    engine.dispose()


AT = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.timezone.utc)
INSERT = Prepared(insert(T))
BY_NAMES = Prepared(select(T.c.id, T.c.name, T.c.doc, T.c.at)
                    .where(T.c.name.in_(bindparam("w_names", expanding=True)))
                    .order_by(T.c.id))
RENAME = Prepared(update(T).where(T.c.id == bindparam("w_id")))


def test_values_are_processed_both_ways_as_execute_would(engine):
    with engine.begin() as c:
        INSERT.run(c, [{"id": i, "name": f"n{i}", "doc": {"k": [i]}, "at": AT}
                       for i in range(3)])
    with engine.begin() as c:
        # the IN list goes through the column's bind processor too ("n1" is stored "N1")
        got = BY_NAMES.run(c, {"w_names": ["n1", "n2"]})
        expected = c.execute(BY_NAMES.stmt, {"w_names": ["n1", "n2"]}).all()
    assert [tuple(r) for r in expected] == got.rows
    assert [r[:3] for r in got.rows] == [(1, "N1", {"k": [1]}), (2, "N2", {"k": [2]})]
    assert got.rows[0][3].replace(tzinfo=dt.timezone.utc) == AT
    assert got.mapping()["doc"] == {"k": [1]}


def test_an_update_sets_the_named_columns_and_counts_rows(engine):
    with engine.begin() as c:
        INSERT.run(c, {"id": 1, "name": "a", "doc": None, "at": AT})
        assert RENAME.run(c, {"name": "b", "w_id": 1}).rowcount == 1
        assert RENAME.run(c, {"name": "c", "w_id": 9}).rowcount == 0
        assert c.execute(select(T.c.name)).scalar() == "B"


def test_a_missing_parameter_raises_instead_of_binding_null(engine):
    with engine.begin() as c, pytest.raises(exc.StatementError, match="w_id"):
        RENAME.run(c, {"name": "b"})


def test_a_constraint_violation_is_sqlalchemys_integrity_error(engine):
    with engine.begin() as c:
        INSERT.run(c, {"id": 1, "name": "a", "doc": None, "at": AT})
    with pytest.raises(exc.IntegrityError):
        with engine.begin() as c:
            INSERT.run(c, {"id": 1, "name": "again", "doc": None, "at": AT})
    with engine.begin() as c:  # the failed transaction rolled back; the engine goes on
        assert c.execute(select(T.c.name)).scalars().all() == ["A"]


def test_in_lists_of_each_length_are_rendered_once_and_reused(engine, monkeypatch):
    with engine.begin() as c:
        INSERT.run(c, [{"id": i, "name": f"n{i}", "doc": None, "at": AT} for i in range(4)])
    by_names = Prepared(BY_NAMES.stmt)  # its own plans, whatever other tests rendered
    renders = []
    with engine.begin() as c:
        by_names.run(c, {"w_names": ["n0"]})  # the plan exists: count its renders from here
        (plan,) = by_names._plans.values()
        real = plan.compiled._process_parameters_for_postcompile

        def counted(values, *a, **k):
            renders.append(len(values["w_names"]))
            return real(values, *a, **k)
        monkeypatch.setattr(plan.compiled, "_process_parameters_for_postcompile", counted)
        for names in (["n1", "n2"], ["n0", "n3"], ["n2"], ["n3", "n1", "n0"], ["n1"], []):
            got = by_names.run(c, {"w_names": names})
            expected = c.execute(BY_NAMES.stmt, {"w_names": names}).all()
            assert got.rows == [tuple(r) for r in expected]
    # Lengths 2 and 3 rendered once each (1 was rendered before counting); the empty list
    # renders SQLAlchemy's empty-set expression, also once.
    assert sorted(renders) == [0, 2, 3]


def test_insert_rows_splits_rows_over_a_statements_parameter_limit(engine):
    """More rows than one statement's parameters hold (PostgreSQL numbers them with 16
    bits): insert_rows sends them in slices, every row goes in, and a claim counts only
    the rows whose key was free."""
    from broker.storage import fast

    rows = [{"id": i, "name": f"n{i}"} for i in range(fast.MAX_PARAMS)]  # 2 params a row
    assert len(rows) * 2 > fast.MAX_PARAMS and len(rows) * 2 > 65_535 // 2
    with engine.begin() as conn:
        assert fast.insert_rows(conn, T, rows) == len(rows)
    with engine.begin() as conn:
        assert conn.execute(select(T.c.id)).scalars().all() == list(range(len(rows)))
        assert conn.execute(select(T.c.name).where(T.c.id == 7)).scalar() == "N7"
        again = rows[-3:] + [{"id": len(rows) + i, "name": "x"} for i in range(40_000)]
        assert fast.insert_rows(conn, T, again, claim=engine.dialect.name) == 40_000
    assert list(fast.chunks(list(range(10)), fast.MAX_PARAMS // 4)) == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
