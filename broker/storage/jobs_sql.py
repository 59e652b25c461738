"""SqlJobRepository: the JobRepository port on SQLAlchemy (SQLite and PostgreSQL).

Every state change is one conditional UPDATE (``WHERE state IN (...)``) plus its event in
the same transaction, so two threads or two broker replicas can never both move a job.
"""
from __future__ import annotations

import time
from typing import Iterable

from sqlalchemy import delete, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from broker.jobs.model import Job, JobEvent, JobOutput, JobState, LEASED
from .models import JobEventRow, JobOutputRow, JobRow

_FIELDS = [c for c in Job.__dataclass_fields__]
JOBS = JobRow.__table__
# Hot paths read through Core (plain rows), not the ORM's identity map: several times
# cheaper per call, and jobs are immutable snapshots for the domain anyway.
_SELECT = select(*[JOBS.c[name] for name in _FIELDS])


def _to_job(row) -> Job:
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
        self.clock = clock

    def create(self, job: Job, first_event: tuple[str, dict]) -> tuple[Job, bool]:
        try:
            with self.sessions.begin() as s:
                s.execute(insert(JobRow).values(**_row_values(job)))
                s.execute(insert(JobEventRow).values(job_id=job.id, kind=first_event[0],
                                                     data=first_event[1], created_at=job.created_at))
            return job, True
        except IntegrityError:
            if job.idempotency_key is None:
                raise
            with self.sessions() as s:
                row = s.scalars(select(JobRow).where(
                    JobRow.account_id == job.account_id,
                    JobRow.idempotency_key == job.idempotency_key)).first()
                if row is None:
                    raise
                return _to_job(row), False

    def get(self, job_id: str) -> Job | None:
        with self.sessions() as s:
            row = s.execute(_SELECT.where(JOBS.c.id == job_id)).first()
            return _to_job(row) if row else None

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
        with self.sessions() as s:
            # A check job waits out its random delay (not_before) before it is offered.
            rows = s.execute(_SELECT.where(JOBS.c.state == JobState.QUEUED.value,
                                           or_(JOBS.c.not_before.is_(None),
                                               JOBS.c.not_before <= self.clock()))
                             .order_by(JOBS.c.created_at).limit(limit))
            return [_to_job(r) for r in rows]

    def transition(self, job_id: str, expect: Iterable[JobState], to: JobState, *,
                   expect_attempt: int | None = None, expect_provider: str | None = None,
                   event: tuple[str, dict] | None = None,
                   events: list[tuple[str, dict]] | None = None,
                   outputs: list[JobOutput] | None = None, **fields) -> Job | None:
        now = self.clock()
        all_events = ([event] if event else []) + list(events or [])
        cond = [JobRow.id == job_id, JobRow.state.in_([e.value for e in expect])]
        if expect_attempt is not None:
            cond.append(JobRow.attempt == expect_attempt)
        if expect_provider is not None:
            cond.append(JobRow.provider_id == expect_provider)
        with self.sessions.begin() as s:
            result = s.execute(update(JobRow).where(*cond)
                               .values(state=to.value, updated_at=now, **fields))
            if result.rowcount != 1:
                return None
            for kind, data in all_events:
                s.execute(insert(JobEventRow).values(job_id=job_id, kind=kind, data=data,
                                                     created_at=now))
            for o in outputs or []:
                s.execute(insert(JobOutputRow).values(job_id=o.job_id, index=o.index,
                                                      sha256=o.sha256, media_type=o.media_type,
                                                      size=o.size))
            return _to_job(s.execute(_SELECT.where(JOBS.c.id == job_id)).first())

    def add_event(self, job_id: str, kind: str, data: dict, **fields) -> int:
        now = self.clock()
        with self.sessions.begin() as s:
            if fields:
                s.execute(update(JobRow).where(JobRow.id == job_id).values(updated_at=now, **fields))
            result = s.execute(insert(JobEventRow).values(job_id=job_id, kind=kind, data=data,
                                                          created_at=now))
            return int(result.inserted_primary_key[0])

    def events_after(self, job_id: str, after_id: int, limit: int = 500) -> list[JobEvent]:
        with self.sessions() as s:
            rows = s.scalars(select(JobEventRow).where(JobEventRow.job_id == job_id,
                                                       JobEventRow.id > after_id)
                             .order_by(JobEventRow.id).limit(limit))
            return [JobEvent(r.id, r.job_id, r.kind, r.data, r.created_at) for r in rows]

    def expired_leases(self, now: float, limit: int = 100) -> list[Job]:
        with self.sessions() as s:
            rows = s.execute(_SELECT.where(JOBS.c.state.in_([x.value for x in LEASED]),
                                           JOBS.c.lease_expires_at < now)
                             .order_by(JOBS.c.lease_expires_at).limit(limit))
            return [_to_job(r) for r in rows]

    def extend_leases(self, provider_id: str, job_ids: list[str], until: float) -> int:
        if not job_ids:
            return 0
        with self.sessions.begin() as s:
            result = s.execute(update(JobRow).where(
                JobRow.provider_id == provider_id, JobRow.id.in_(job_ids),
                JobRow.state.in_([x.value for x in LEASED])).values(lease_expires_at=until))
            return result.rowcount

    def leased_to(self, provider_id: str) -> list[Job]:
        with self.sessions() as s:
            rows = s.scalars(select(JobRow).where(JobRow.provider_id == provider_id,
                                                  JobRow.state.in_([x.value for x in LEASED])))
            return [_to_job(r) for r in rows]

    def outputs(self, job_id: str) -> list[JobOutput]:
        with self.sessions() as s:
            rows = s.scalars(select(JobOutputRow).where(JobOutputRow.job_id == job_id)
                             .order_by(JobOutputRow.index))
            return [JobOutput(r.job_id, r.index, r.sha256, r.media_type, r.size) for r in rows]

    def replace_outputs(self, job_id: str, outputs: list[JobOutput],
                        event: tuple[str, dict]) -> None:
        """Point a settled job at other outputs (verification overturned it: the majority's
        outputs replace the wrong ones), with its event, in one transaction."""
        with self.sessions.begin() as s:
            s.execute(delete(JobOutputRow).where(JobOutputRow.job_id == job_id))
            for o in outputs:
                s.execute(insert(JobOutputRow).values(job_id=job_id, index=o.index,
                                                      sha256=o.sha256, media_type=o.media_type,
                                                      size=o.size))
            s.execute(insert(JobEventRow).values(job_id=job_id, kind=event[0], data=event[1],
                                                 created_at=self.clock()))

    def checks_of(self, job_id: str) -> list[Job]:
        """The check jobs that re-run ``job_id``, oldest first."""
        with self.sessions() as s:
            rows = s.execute(_SELECT.where(JOBS.c.check_of == job_id)
                             .order_by(JOBS.c.created_at))
            return [_to_job(r) for r in rows]

    def counts_by_state(self) -> dict[str, int]:
        with self.sessions() as s:
            return {state: n for state, n in
                    s.execute(select(JobRow.state, func.count()).group_by(JobRow.state))}
