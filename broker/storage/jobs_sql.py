"""SqlJobRepository: the JobRepository port on SQLAlchemy (SQLite and PostgreSQL).

Every state change is one conditional UPDATE (``WHERE state IN (...)``) plus its event in
the same transaction, so two threads or two broker replicas can never both move a job.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterable, Iterator

from sqlalchemy import bindparam, delete, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from broker.jobs.model import Job, JobEvent, JobOutput, JobState, LEASED
from .base import atomic, begin, flat, read_only
from .fast import Prepared, insert_rows
from .models import JobEventRow, JobOutputRow, JobRow

_FIELDS = [c for c in Job.__dataclass_fields__]
_FIELD_SET = frozenset(_FIELDS)
JOBS = JobRow.__table__
EVENTS = JobEventRow.__table__
OUTPUTS = JobOutputRow.__table__
_LEASED_STATES = [x.value for x in LEASED]
# Hot paths read through Core (plain rows), not the ORM's identity map: several times
# cheaper per call, and jobs are immutable snapshots for the domain anyway.
_COLUMNS = [JOBS.c[name] for name in _FIELDS]
_SELECT = select(*_COLUMNS)

# Statements are built once, here, and executed with parameter dicts: building a construct
# (``insert(...).values(**kw)``, ``x == value``) and computing its cache key cost about
# 0.3 ms per statement, more than SQLite takes to run it. A prebuilt statement's cache key
# is memoised on the object, so each call goes straight to the compiled-statement cache.
# Where-clause parameters are named ``w_*`` so they never collide with a column (an UPDATE
# without ``.values()`` SETs exactly the columns named in the parameters).
# The hottest also run as Prepared statements (broker/storage/fast.py): straight on the
# DBAPI cursor with SQLAlchemy's own value processing.
_GET = Prepared(_SELECT.where(JOBS.c.id == bindparam("w_id")))
_LEASE = Prepared(select(JOBS.c.state, JOBS.c.provider_id, JOBS.c.attempt)
                  .where(JOBS.c.id == bindparam("w_id")))
_INSERT_JOB = Prepared(insert(JOBS))
_INSERT_EVENT = Prepared(insert(EVENTS))
_INSERT_OUTPUT = Prepared(insert(OUTPUTS))
_UPDATE_JOB = update(JOBS).where(JOBS.c.id == bindparam("w_id"))
_QUEUED = Prepared(_SELECT.where(JOBS.c.state == JobState.QUEUED.value,
                         or_(JOBS.c.not_before.is_(None), JOBS.c.not_before <= bindparam("w_now")))
           .order_by(JOBS.c.created_at).limit(bindparam("w_limit")))
# (every event stream reads it again after each quiet slice, thousands of them at once)
_EVENTS_AFTER = Prepared(select(EVENTS.c.id, EVENTS.c.job_id, EVENTS.c.kind, EVENTS.c.data,
                                EVENTS.c.created_at)
                         .where(EVENTS.c.job_id == bindparam("w_id"),
                                EVENTS.c.id > bindparam("w_after"))
                         .order_by(EVENTS.c.id).limit(bindparam("w_limit")))
_OUTPUTS_OF = Prepared(select(OUTPUTS.c.job_id, OUTPUTS.c.index, OUTPUTS.c.sha256,
                              OUTPUTS.c.media_type, OUTPUTS.c.size)
                       .where(OUTPUTS.c.job_id == bindparam("w_id")).order_by(OUTPUTS.c.index))
_EXTEND_LEASES = (update(JOBS).where(JOBS.c.provider_id == bindparam("w_provider"),
                                     JOBS.c.id.in_(bindparam("w_ids", expanding=True)),
                                     JOBS.c.state.in_(_LEASED_STATES)))
_LEASED_TO = Prepared(_SELECT.where(JOBS.c.provider_id == bindparam("w_provider"),
                           JOBS.c.state.in_(_LEASED_STATES)))


def _transition_statement(with_attempt: bool, with_provider: bool, returning: bool):
    """The conditional UPDATE of a transition: ``WHERE id = :w_id AND state IN :w_states``
    (+ attempt, + provider), SET from the parameters; with RETURNING of the new row where
    the database has it (SQLite >= 3.35, PostgreSQL), so no second SELECT is needed."""
    cond = [JOBS.c.id == bindparam("w_id"), JOBS.c.state.in_(bindparam("w_states", expanding=True))]
    if with_attempt:
        cond.append(JOBS.c.attempt == bindparam("w_attempt"))
    if with_provider:
        cond.append(JOBS.c.provider_id == bindparam("w_provider"))
    stmt = update(JOBS).where(*cond)
    return Prepared(stmt.returning(*_COLUMNS) if returning else stmt)


_TRANSITIONS = {(a, p, r): _transition_statement(a, p, r)
                for a in (False, True) for p in (False, True) for r in (False, True)}


def _check_fields(fields: dict) -> None:
    # A statement executed with parameters ignores keys that name no column; a typo must
    # fail loudly, as ``.values(**fields)`` did.
    unknown = fields.keys() - _FIELD_SET
    if unknown:
        raise TypeError(f"not a job column: {sorted(unknown)}")


def _to_job(row) -> Job:
    """A Job from a row: a tuple in _FIELDS order (a Prepared statement's), a Row or an
    ORM object."""
    if isinstance(row, tuple) and not hasattr(row, "_mapping"):
        values = dict(zip(_FIELDS, row))
    else:
        values = dict(row._mapping) if hasattr(row, "_mapping") else {
            name: getattr(row, name) for name in _FIELDS}
    values["state"] = JobState(values["state"])
    values["excluded_providers"] = list(values["excluded_providers"] or [])
    return Job(**values)


def _row_values(job: Job) -> dict:
    values = {name: getattr(job, name) for name in _FIELDS}
    values["state"] = job.state.value
    return values


class SqlJobRepository:
    def __init__(self, sessions: sessionmaker[Session], clock=time.time):
        self.sessions = sessions
        # The hot paths run Core statements on the engine's connections (no ORM session).
        self.engine = sessions.kw["bind"]
        self.clock = clock
        self._returning = bool(self.engine.dialect.update_returning)
        # The largest id an event can have: job_events.id is an INTEGER column, 32 bits on
        # PostgreSQL (which refuses a larger parameter for it), 64 on SQLite.
        self._max_event_id = 2**31 - 1 if self.engine.dialect.name == "postgresql" else 2**63 - 1
        self._multi_row = self.engine.dialect.name != "sqlite"  # see _write_rows
        self._deferred = threading.local()  # this thread's deferred_rows(), if any

    def atomic(self):
        """One transaction for the block's writes here and in the ledger and audit log
        (same database): see ``broker.storage.base.atomic``."""
        return atomic(self.engine)

    def flat(self):
        """Inside ``atomic``: writes without a savepoint each (``broker.storage.base.flat``)."""
        return flat(self.engine)

    @contextmanager
    def deferred_rows(self) -> Iterator[None]:
        """Inside ``atomic``: the events and outputs that this thread's transitions write
        in the block are kept and written as it ends, one INSERT for all the events and one
        for all the outputs (a receipt batch, issue #28: two statements for the batch
        instead of two per job), in the block's transaction. A job's events keep their
        order; they precede any event written after the block."""
        if getattr(self._deferred, "rows", None) is not None:
            yield  # already deferred by an enclosing block
            return
        rows = self._deferred.rows = ([], [])
        try:
            yield
        finally:
            self._deferred.rows = None
        with flat(self.engine), begin(self.engine) as c:  # a failure fails the block
            self._write_rows(c, *rows)

    def _write_rows(self, c, events: list[dict], outputs: list[dict]) -> None:
        """Insert event and output rows: PostgreSQL one multi-row INSERT each (psycopg's
        executemany would run one statement per row); SQLite steps one prepared INSERT per
        row faster than it runs a multi-row one."""
        for stmt, table, rows in ((_INSERT_EVENT, EVENTS, events),
                                  (_INSERT_OUTPUT, OUTPUTS, outputs)):
            if not rows:
                continue
            if self._multi_row and len(rows) > 1:
                insert_rows(c, table, rows)
            else:
                stmt.run(c, rows)

    def create(self, job: Job, first_event: tuple[str, dict]) -> tuple[Job, bool]:
        try:
            with begin(self.engine) as c:
                _INSERT_JOB.run(c, _row_values(job))
                _INSERT_EVENT.run(c, {"job_id": job.id, "kind": first_event[0],
                                      "data": first_event[1], "created_at": job.created_at})
            return job, True
        except IntegrityError:
            if job.idempotency_key is None:
                raise
            # Read where the conflict was met: in the caller's transaction when there is
            # one. On SQLite's group commit the row it met may be an earlier request's
            # that is written but not yet committed (the next transaction starts on the
            # same connection before the COMMIT), which another connection does not see;
            # on PostgreSQL it is committed (a unique check waits for the other writer).
            with begin(self.engine) as c:
                row = c.execute(_SELECT.where(
                    JOBS.c.account_id == job.account_id,
                    JOBS.c.idempotency_key == job.idempotency_key)).first()
            if row is None:
                raise
            return _to_job(row), False

    def get(self, job_id: str) -> Job | None:
        with read_only(self.engine) as c:
            row = _GET.run(c, {"w_id": job_id}).first()
            return _to_job(row) if row else None

    def lease_of(self, job_id: str) -> tuple[JobState, str | None, int] | None:
        with read_only(self.engine) as c:
            row = _LEASE.run(c, {"w_id": job_id}).first()
            return (JobState(row[0]), row[1], row[2]) if row else None

    def list_for_account(self, account_id: str, limit: int = 50) -> list[Job]:
        with self.sessions() as s:
            rows = s.scalars(select(JobRow).where(JobRow.account_id == account_id)
                             .order_by(JobRow.created_at.desc()).limit(limit))
            return [_to_job(r) for r in rows]

    def batch(self, batch_id: str) -> list[Job]:
        """The siblings of a split request, by index."""
        with self.sessions() as s:
            rows = s.execute(_SELECT.where(JOBS.c.batch_id == batch_id)
                             .order_by(JOBS.c.batch_index))
            return [_to_job(r) for r in rows]

    def queued(self, limit: int) -> list[Job]:
        with read_only(self.engine) as c:
            # A check job waits out its random delay (not_before) before it is offered.
            rows = _QUEUED.run(c, {"w_now": self.clock(), "w_limit": limit})
            return [_to_job(r) for r in rows]

    def transition(self, job_id: str, expect: Iterable[JobState], to: JobState, *,
                   expect_attempt: int | None = None, expect_provider: str | None = None,
                   event: tuple[str, dict] | None = None,
                   events: list[tuple[str, dict]] | None = None,
                   outputs: list[JobOutput] | None = None, **fields) -> Job | None:
        _check_fields(fields)
        now = self.clock()
        all_events = ([event] if event else []) + list(events or [])
        params = {"state": to.value, "updated_at": now, **fields,
                  "w_id": job_id, "w_states": [e.value for e in expect]}
        if expect_attempt is not None:
            params["w_attempt"] = expect_attempt
        if expect_provider is not None:
            params["w_provider"] = expect_provider
        stmt = _TRANSITIONS[(expect_attempt is not None, expect_provider is not None,
                             self._returning)]
        with begin(self.engine) as c:
            result = stmt.run(c, params)
            if self._returning:
                row = result.first()
                if row is None:
                    return None
            elif result.rowcount != 1:
                return None
            event_rows = [{"job_id": job_id, "kind": kind, "data": data, "created_at": now}
                          for kind, data in all_events]
            output_rows = [{"job_id": o.job_id, "index": o.index, "sha256": o.sha256,
                            "media_type": o.media_type, "size": o.size} for o in outputs or ()]
            deferred = getattr(self._deferred, "rows", None)
            if deferred is not None:  # written as deferred_rows() ends
                deferred[0].extend(event_rows)
                deferred[1].extend(output_rows)
            else:
                if event_rows:
                    _INSERT_EVENT.run(c, event_rows)
                if output_rows:
                    _INSERT_OUTPUT.run(c, output_rows)
            if not self._returning:
                row = _GET.run(c, {"w_id": job_id}).first()
            return _to_job(row)

    def add_event(self, job_id: str, kind: str, data: dict, **fields) -> int:
        now = self.clock()
        _check_fields(fields)
        with begin(self.engine) as c:
            if fields:
                c.execute(_UPDATE_JOB, {"updated_at": now, **fields, "w_id": job_id})
            result = c.execute(_INSERT_EVENT.stmt, {"job_id": job_id, "kind": kind,
                                                    "data": data, "created_at": now})
            return int(result.inserted_primary_key[0])

    def events_after(self, job_id: str, after_id: int, limit: int = 500) -> list[JobEvent]:
        """Events after ``after_id`` (any integer; one past every id there can be: none)."""
        with read_only(self.engine) as c:
            rows = _EVENTS_AFTER.run(c, {"w_id": job_id,
                                         "w_after": min(after_id, self._max_event_id),
                                         "w_limit": limit})
            return [JobEvent(*r) for r in rows]

    def expired_leases(self, now: float, limit: int = 100) -> list[Job]:
        with self.sessions() as s:
            rows = s.execute(_SELECT.where(JOBS.c.state.in_([x.value for x in LEASED]),
                                           JOBS.c.lease_expires_at < now)
                             .order_by(JOBS.c.lease_expires_at).limit(limit))
            return [_to_job(r) for r in rows]

    def overdue(self, now: float, limit: int = 100) -> list[Job]:
        """Unfinished jobs (queued or leased) whose deadline (``created_at + deadline_s``)
        passed before ``now``, oldest first."""
        with self.sessions() as s:
            rows = s.execute(_SELECT.where(
                JOBS.c.state.in_([JobState.QUEUED.value] + [x.value for x in LEASED]),
                JOBS.c.deadline_s.is_not(None),
                JOBS.c.created_at + JOBS.c.deadline_s < now)
                .order_by(JOBS.c.created_at).limit(limit))
            return [_to_job(r) for r in rows]

    def extend_leases(self, provider_id: str, job_ids: list[str], until: float) -> int:
        if not job_ids:
            return 0
        with begin(self.engine) as c:
            result = c.execute(_EXTEND_LEASES, {"lease_expires_at": until,
                                                "w_provider": provider_id, "w_ids": list(job_ids)})
            return result.rowcount

    def leased_to(self, provider_id: str) -> list[Job]:
        with read_only(self.engine) as c:
            return [_to_job(r) for r in _LEASED_TO.run(c, {"w_provider": provider_id})]

    def outputs(self, job_id: str) -> list[JobOutput]:
        with read_only(self.engine) as c:
            return [JobOutput(*r) for r in _OUTPUTS_OF.run(c, {"w_id": job_id})]

    def replace_outputs(self, job_id: str, outputs: list[JobOutput],
                        event: tuple[str, dict]) -> None:
        """Point a settled job at other outputs (verification overturned it: the majority's
        outputs replace the wrong ones), with its event, in one transaction."""
        with begin(self.engine) as c:
            c.execute(delete(OUTPUTS).where(OUTPUTS.c.job_id == job_id))
            if outputs:
                _INSERT_OUTPUT.run(c, [{"job_id": job_id, "index": o.index,
                                        "sha256": o.sha256, "media_type": o.media_type,
                                        "size": o.size} for o in outputs])
            _INSERT_EVENT.run(c, {"job_id": job_id, "kind": event[0], "data": event[1],
                                  "created_at": self.clock()})

    def checks_of(self, job_id: str) -> list[Job]:
        """The check jobs that re-run ``job_id``, oldest first."""
        with self.sessions() as s:
            rows = s.execute(_SELECT.where(JOBS.c.check_of == job_id)
                             .order_by(JOBS.c.created_at))
            return [_to_job(r) for r in rows]

    def cache_sources(self, cache_key: str, limit: int = 5) -> list[Job]:
        """Settled jobs (not themselves answered from the cache) whose result-cache key is
        ``cache_key``, newest first."""
        with self.sessions() as s:
            rows = s.execute(_SELECT.where(JOBS.c.cache_key == cache_key,
                                           JOBS.c.state == JobState.SETTLED.value,
                                           JOBS.c.cached_from.is_(None))
                             .order_by(JOBS.c.finished_at.desc()).limit(limit))
            return [_to_job(r) for r in rows]

    def counts_by_state(self) -> dict[str, int]:
        with self.sessions() as s:
            return {state: n for state, n in
                    s.execute(select(JobRow.state, func.count()).group_by(JobRow.state))}
