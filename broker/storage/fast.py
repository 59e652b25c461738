"""Prepared: a prebuilt Core statement run straight on the connection's DBAPI cursor.

The per-job storage path runs about forty statements. SQLAlchemy's ``Connection.execute``
spends about 0.13 ms of Python on each (an execution context, cache lookups, events, a
result object) while SQLite takes about 0.02 ms to run it, so the wrapper, not the
database, was a third of the broker's CPU per job. A :class:`Prepared` statement is compiled
once per dialect and set of columns by SQLAlchemy itself, and then executed with
SQLAlchemy's own bind and result processors (JSON, DateTime, Boolean …), so the values
that reach and leave the database are the ones ``Connection.execute`` would produce; only
the bookkeeping around them is skipped. It runs inside the caller's transaction (the same
DBAPI connection), and it falls back to ``Connection.execute`` for any statement that needs
more of SQLAlchemy than this (Python-side column defaults, for instance).

Statement-level events (``before_cursor_execute``) do not fire for these statements.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from sqlalchemy import exc
from sqlalchemy.engine import Connection


class Rows:
    """What a prepared statement returned: ``rows`` (tuples, processed), ``names`` and
    ``rowcount``."""

    __slots__ = ("rows", "names", "rowcount")

    def __init__(self, rows: list[tuple], names: Sequence[str], rowcount: int):
        self.rows, self.names, self.rowcount = rows, names, rowcount

    def first(self) -> tuple | None:
        return self.rows[0] if self.rows else None

    def mapping(self) -> dict | None:
        """The first row as a dict by column name (None when there is none)."""
        return dict(zip(self.names, self.rows[0])) if self.rows else None

    def mappings(self) -> list[dict]:
        return [dict(zip(self.names, r)) for r in self.rows]

    def __iter__(self):
        return iter(self.rows)


class _Plan:
    __slots__ = ("compiled", "sql", "positional", "positions", "binds", "names", "results",
                 "expanding", "fallback", "params", "expanded", "by_position")

    def result_processors(self, dialect, description) -> list[tuple[int, Any]]:
        """(column index, processor) of each result column that has one, given the column
        types the driver reports (the PostgreSQL dialect picks a processor by type code)."""
        if self.results is None:
            columns = self.compiled._result_columns or []
            procs = [rc.type._cached_result_processor(dialect, d[1])
                     for rc, d in zip(columns, description)]
            self.results = [(i, p) for i, p in enumerate(procs) if p is not None]
        return self.results


class Prepared:
    """``Prepared(stmt).run(conn, params)`` executes ``stmt`` on ``conn`` (a Connection in
    a transaction) with one parameter dict, or with a list of them (executemany; no rows
    come back). Parameters name columns (for INSERT/UPDATE ``SET``) and bind parameters,
    exactly as with ``conn.execute(stmt, params)``."""

    def __init__(self, stmt):
        self.stmt = stmt
        self._plans: dict[tuple, _Plan] = {}

    def _plan(self, conn: Connection, keys: tuple[str, ...]) -> _Plan:
        dialect = conn.dialect
        cache_key = (id(dialect), keys)
        plan = self._plans.get(cache_key)
        if plan is not None:
            return plan
        plan = _Plan()
        compiled = self.stmt.compile(dialect=dialect, column_keys=list(keys))
        plan.compiled = compiled
        # Python-side defaults are computed by the execution context; literal-execute
        # parameters are rendered into the SQL at execution: both stay with SQLAlchemy.
        plan.fallback = bool(getattr(compiled, "insert_prefetch", None)
                             or getattr(compiled, "update_prefetch", None)
                             or compiled.literal_execute_params)
        plan.expanding = bool(compiled.post_compile_params)
        plan.sql = compiled.string
        plan.positional = compiled.positional
        plan.positions = list(compiled.positiontup or ())
        plan.binds = dict(compiled._bind_processors)
        plan.names = [rc.keyname for rc in compiled._result_columns or []]
        plan.results = None  # result processors: set from the first cursor description
        # What construct_params does per bind parameter, decided once: where its value
        # comes from (the caller's key, else its name), else its own value or an error.
        plan.params = [(name, bp.key, bp.required, bp) for bp, name in compiled.bind_names.items()]
        # The same, in the order a positional driver takes them, each with its processor:
        # what _args walks once for such a statement (no IN list to expand).
        specs = {name: (name, key, required, bp) for name, key, required, bp in plan.params}
        plan.by_position = ([(*specs[k], plan.binds.get(k)) for k in plan.positions]
                            if compiled.positional and not plan.expanding
                            and all(k in specs for k in plan.positions) else None)
        # Expanded IN lists by their lengths: (sql, positions, processors), or None where
        # SQLAlchemy's expansion is not the plain name_1, name_2… this code reproduces.
        plan.expanded = {}
        self._plans[cache_key] = plan
        return plan

    def _args(self, plan: _Plan, params: dict) -> tuple[str, Any]:
        """The SQL and the DBAPI parameters, as DefaultExecutionContext builds them: every
        bind parameter required (a missing one raises, never binds NULL), expanding IN
        lists rendered, each value through its processor, names escaped."""
        if plan.by_position is not None:
            args = []
            for name, key, required, bp, proc in plan.by_position:
                if key in params:
                    value = params[key]
                elif name in params:
                    value = params[name]
                elif required:
                    raise exc.InvalidRequestError(
                        f"A value is required for bind parameter {key!r}", code="cd3x")
                else:
                    value = bp.effective_value if bp.callable else bp.value
                args.append(value if proc is None else proc(value))
            return plan.sql, args
        values = {}
        for name, key, required, bp in plan.params:
            if key in params:
                values[name] = params[key]
            elif name in params:
                values[name] = params[name]
            elif required:
                raise exc.InvalidRequestError(
                    f"A value is required for bind parameter {key!r}", code="cd3x")
            else:
                values[name] = bp.effective_value if bp.callable else bp.value
        sql, order, procs = plan.sql, plan.positions, plan.binds
        if plan.expanding:
            sql, order, procs, values = self._expand(plan, values)
        if plan.positional:
            return sql, [procs[k](values[k]) if k in procs else values[k] for k in order]
        escaped = plan.compiled.escaped_bind_names or {}
        return sql, {escaped.get(k, k): (procs[k](v) if k in procs else v)
                     for k, v in values.items()}

    @staticmethod
    def _expand(plan: _Plan, values: dict):
        """IN lists rendered for the lengths of these values: SQLAlchemy renders them the
        first time for each set of lengths; later calls reuse its SQL and only spread the
        values (``w_ids`` → ``w_ids_1``, ``w_ids_2``…)."""
        compiled = plan.compiled
        names = compiled.post_compile_params
        lengths = tuple(len(values[bp.key]) if isinstance(values.get(bp.key), (list, tuple))
                        else -1 for bp in names)
        cached = plan.expanded.get(lengths)
        if cached is not None:
            return (*cached, _spread(values, names))
        state = compiled._process_parameters_for_postcompile(values)
        procs = {**plan.binds, **state.processors}
        if -1 not in lengths and _spread(values, names) == dict(state.parameters):
            plan.expanded[lengths] = (state.statement, state.positiontup, procs)
        return state.statement, state.positiontup, procs, dict(state.parameters)

    def run(self, conn: Connection, params: dict | Iterable[dict] | None = None) -> Rows:
        many = isinstance(params, list)
        first = (params[0] if params else {}) if many else (params or {})
        plan = self._plan(conn, tuple(sorted(first)))
        if plan.fallback or (many and plan.expanding):
            result = conn.execute(self.stmt, params)
            rows = [tuple(r) for r in result] if result.returns_rows else []
            return Rows(rows, list(result.keys()) if result.returns_rows else [],
                        result.rowcount)
        cursor = conn.connection.dbapi_connection.cursor()
        sql, args = plan.sql, None
        try:
            if many:
                batch = []
                for p in params:
                    sql, args = self._args(plan, p)
                    batch.append(args)
                cursor.executemany(sql, batch)
                return Rows([], [], cursor.rowcount)
            sql, args = self._args(plan, first)
            cursor.execute(sql, args)
            rows, procs = [], ()
            description = cursor.description  # psycopg builds it anew on every read
            if description is not None:
                rows = cursor.fetchall()
                procs = plan.result_processors(conn.dialect, description)
            rowcount = cursor.rowcount
        except Exception as error:  # noqa: BLE001 - handled as Connection.execute does
            # Wrapped (IntegrityError … with .orig), a lost connection invalidated, and the
            # engine's handle_error hooks run: the same as for any other statement.
            conn._handle_dbapi_exception(error, sql, args, cursor, None)
        finally:
            cursor.close()
        if rows and procs:
            rows = [_processed(r, procs) for r in rows]
        return Rows(rows, plan.names, rowcount)


    def run_each(self, conn: Connection, params: list[dict]) -> list[Rows]:
        """Execute the statement once per parameter dict of ``params`` and return what each
        execution returned (a statement with RETURNING): on psycopg one ``executemany`` with
        ``returning=True`` (the executions go to the server as one pipeline); elsewhere one
        :meth:`run` each."""
        if not params:
            return []
        plan = self._plan(conn, tuple(sorted(params[0])))
        if plan.fallback or plan.expanding or conn.dialect.driver != "psycopg":
            return [self.run(conn, p) for p in params]
        cursor = conn.connection.dbapi_connection.cursor()
        sql, batch, out = plan.sql, [], []
        try:
            for p in params:
                sql, args = self._args(plan, p)
                batch.append(args)
            cursor.executemany(sql, batch, returning=True)
            while True:
                description = cursor.description
                rows = cursor.fetchall() if description is not None else []
                if rows:
                    procs = plan.result_processors(conn.dialect, description)
                    if procs:
                        rows = [_processed(r, procs) for r in rows]
                out.append(Rows(rows, plan.names, cursor.rowcount))
                if not cursor.nextset():
                    break
        except Exception as error:  # noqa: BLE001 - handled as Connection.execute does
            conn._handle_dbapi_exception(error, sql, batch, cursor, None)
        finally:
            cursor.close()
        return out

_ROWS_INSERTS: dict[tuple, Prepared] = {}


def rows_insert(table, columns: tuple[str, ...], rows: int, claim: str | None = None
                ) -> Prepared:
    """One INSERT of ``rows`` rows of ``columns``, ``VALUES (:w_<column><i>, …), …`` (one
    statement where an executemany is one per row), built once per table, columns and
    number of rows; with ``claim`` (a dialect name), one that inserts nothing where the
    primary key exists. Parameters: :func:`rows_params`."""
    cache_key = (table.name, columns, rows, claim)
    stmt = _ROWS_INSERTS.get(cache_key)
    if stmt is None:
        if claim is None:
            from sqlalchemy import insert as maker
        elif claim == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as maker
        else:
            from sqlalchemy.dialects.sqlite import insert as maker
        from sqlalchemy import bindparam
        built = maker(table).values([
            {c: bindparam(f"w_{c}{i}", type_=table.c[c].type) for c in columns}
            for i in range(rows)])
        if claim is not None:
            built = built.on_conflict_do_nothing(index_elements=list(table.primary_key))
        stmt = _ROWS_INSERTS.setdefault(cache_key, Prepared(built))
    return stmt


# PostgreSQL's protocol numbers a statement's parameters with 16 bits (at most 65,535);
# SQLite's default limit is 32,766. A multi-row INSERT over it fails on the server, so
# :func:`insert_rows` splits its rows into statements under the smaller of the two.
MAX_PARAMS = 32_766


def chunks(rows: list, columns: int) -> Iterable[list]:
    """``rows`` in consecutive slices of at most :data:`MAX_PARAMS` parameters each
    (``columns`` per row)."""
    step = max(1, MAX_PARAMS // max(1, columns))
    for start in range(0, len(rows), step):
        yield rows[start:start + step]


def insert_rows(conn: Connection, table, rows: list[dict], claim: str | None = None) -> int:
    """Insert ``rows`` (dicts by column, each with the same columns) with
    :func:`rows_insert`: one statement, or one per slice of :func:`chunks` where they carry
    more parameters than a statement takes. Returns the rows inserted (with ``claim``,
    those whose key was free)."""
    columns = tuple(rows[0])
    inserted = 0
    for part in chunks(rows, len(columns)):
        inserted += rows_insert(table, columns, len(part), claim).run(
            conn, rows_params(part)).rowcount
    return inserted


def rows_params(rows: list[dict]) -> dict:
    """The parameters of :func:`rows_insert` for ``rows`` (dicts by column, each with the
    same columns)."""
    return {f"w_{c}{i}": v for i, row in enumerate(rows) for c, v in row.items()}


def _processed(row: tuple, procs: list[tuple[int, Any]]) -> tuple:
    """``row`` with each processed column through its processor."""
    row = list(row)
    for i, proc in procs:
        row[i] = proc(row[i])
    return tuple(row)


def _spread(values: dict, expanding) -> dict:
    """``values`` with each expanding list spread over ``name_1``, ``name_2``… as
    SQLAlchemy names the parameters of a rendered IN list."""
    spread = dict(values)
    for bp in expanding:
        for i, v in enumerate(spread.pop(bp.key, None) or (), 1):
            spread[f"{bp.key}_{i}"] = v
    return spread
