"""SqlCheckpointRepository: the latest checkpoint of each attempt of a job (table
``job_checkpoints``, migration 0005_checkpoints). The bytes live in the blob store."""
from __future__ import annotations

import time

from sqlalchemy import BigInteger, Float, ForeignKey, Integer, String, bindparam, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from broker.jobs.checkpoints import CheckpointRecord
from .base import Base, read_only


class JobCheckpointRow(Base):
    __tablename__ = "job_checkpoints"
    job_id: Mapped[str] = mapped_column(String(36), ForeignKey("jobs.id"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    provider_id: Mapped[str] = mapped_column(String(36))
    base_step: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    total: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(Integer)
    rate_micro_per_unit: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)


_COLUMNS = [c.name for c in JobCheckpointRow.__table__.columns]
_TABLE = JobCheckpointRow.__table__
# Built once (see jobs_sql.py); every assignment reads a job's checkpoints.
_FOR_JOB = (select(*[_TABLE.c[c] for c in _COLUMNS]).where(_TABLE.c.job_id == bindparam("w_id"))
            .order_by(_TABLE.c.attempt))


def _record(row) -> CheckpointRecord:
    return CheckpointRecord(**{c: getattr(row, c) for c in _COLUMNS})


class SqlCheckpointRepository:
    def __init__(self, sessions: sessionmaker[Session], clock=time.time):
        self.sessions = sessions
        self.clock = clock

    def save(self, rec: CheckpointRecord, _retried: bool = False) -> bool:
        """Insert, or move the attempt's row forward; never backward (a late, older
        checkpoint of the same attempt is ignored). True when stored."""
        values = {c: getattr(rec, c) for c in _COLUMNS}
        T = JobCheckpointRow
        with self.sessions.begin() as s:
            moved = s.execute(update(T).where(T.job_id == rec.job_id, T.attempt == rec.attempt,
                                              T.step < rec.step)
                              .values(step=rec.step, total=rec.total, sha256=rec.sha256,
                                      size=rec.size, created_at=rec.created_at))
            if moved.rowcount == 1:
                return True
            if s.get(T, (rec.job_id, rec.attempt)) is not None:
                return False
        try:
            with self.sessions.begin() as s:
                s.add(JobCheckpointRow(**values))
            return True
        except IntegrityError:
            if _retried:  # not a race: e.g. no such job (foreign key); say so
                raise
            return self.save(rec, _retried=True)  # a racing first checkpoint of the attempt

    def for_job(self, job_id: str) -> list[CheckpointRecord]:
        with read_only(self.sessions.kw["bind"]) as c:
            return [_record(r) for r in c.execute(_FOR_JOB, {"w_id": job_id})]



def leased_jobs(sessions: sessionmaker[Session], limit: int = 1000):
    """Leased (matched or running) jobs, longest-running first (for the stall watch)."""
    from broker.jobs.model import LEASED
    from .jobs_sql import JOBS, _SELECT, _to_job

    with sessions() as s:
        rows = s.execute(_SELECT.where(JOBS.c.state.in_([x.value for x in LEASED]))
                         .order_by(JOBS.c.matched_at).limit(limit))
        return [_to_job(r) for r in rows]
