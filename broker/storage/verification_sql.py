"""SQL storage of verification (DESIGN §6): per-job verification records and provider
standing (consecutive valid checks, concurrency quota) per plugin and hardware class."""
from __future__ import annotations

import time
from typing import Any, Callable

from sqlalchemy import (JSON, Float, Index, Integer, String, and_, case, delete, func, or_,
                        select, update)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from broker.jobs.model import TERMINAL, Job, JobState
from broker.verification.records import (CANARY_OUTCOMES, OPEN_STATUSES, CheckStatus,
                                         StandingRecord, Verification)
from broker.verification.sampled_text import SamplingState
from .base import Base, begin

MIN_QUOTA_FACTOR = 0.125


class VerificationRow(Base):
    __tablename__ = "verifications"
    __table_args__ = (Index("ix_verifications_status_updated", "status", "updated_at"),
                      Index("ix_verifications_checker", "checker_job_id"),
                      Index("ix_verifications_tiebreak", "tiebreak_job_id"))
    job_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    plugin: Mapped[str] = mapped_column(String(64))
    provider_id: Mapped[str] = mapped_column(String(36))
    hardware_class: Mapped[str] = mapped_column(String(120))
    status: Mapped[str] = mapped_column(String(20))
    p: Mapped[float] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(String(32))
    draw: Mapped[float] = mapped_column(Float)
    checker_job_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    tiebreak_job_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    comparisons: Mapped[dict] = mapped_column(JSON)
    outcome: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class StandingRow(Base):
    __tablename__ = "provider_standing"
    provider_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    plugin: Mapped[str] = mapped_column(String(64), primary_key=True)
    hardware_class: Mapped[str] = mapped_column(String(120), primary_key=True)
    consecutive_valid: Mapped[int] = mapped_column(Integer)
    checks: Mapped[int] = mapped_column(Integer)
    failures: Mapped[int] = mapped_column(Integer)
    quota_factor: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class CanaryAnswerRow(Base):
    __tablename__ = "canary_answers"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    answer: Mapped[str] = mapped_column(String(64), primary_key=True)
    operators: Mapped[list] = mapped_column(JSON)
    updated_at: Mapped[float] = mapped_column(Float)


class SamplingEvidenceRow(Base):
    """A provider's sampled-text e-process per plugin and witness (the operator whose runs
    gave its e-values: ``sampled_text.SamplingState``); a slash deletes the provider's
    rows of the plugin (each ``verification.sampling_closed`` audit entry records one)."""

    __tablename__ = "sampling_evidence"
    provider_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    plugin: Mapped[str] = mapped_column(String(64), primary_key=True)
    witness: Mapped[str] = mapped_column(String(64), primary_key=True)
    checks: Mapped[int] = mapped_column(Integer)
    log_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    updated_at: Mapped[float] = mapped_column(Float)


class CanaryMissRow(Base):
    """A provider's last canaries per plugin, oldest first: answered ("a"), not answered
    ("m") or away ("o": given back for its machine's owner, or its stream left)."""

    __tablename__ = "canary_misses"
    provider_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    plugin: Mapped[str] = mapped_column(String(64), primary_key=True)
    recent: Mapped[str] = mapped_column(String(64))
    updated_at: Mapped[float] = mapped_column(Float)


_V_FIELDS = [c for c in Verification.__dataclass_fields__]


def _to_v(row: VerificationRow) -> Verification:
    values = {name: getattr(row, name) for name in _V_FIELDS}
    values["status"] = CheckStatus(values["status"])
    values["comparisons"] = dict(values["comparisons"] or {})
    return Verification(**values)


def _to_s(row: StandingRow) -> StandingRecord:
    return StandingRecord(row.provider_id, row.plugin, row.hardware_class,
                          row.consecutive_valid, row.checks, row.failures, row.quota_factor)


class SqlVerificationRepository:
    def __init__(self, sessions: sessionmaker[Session], clock=time.time):
        self.sessions = sessions
        self.clock = clock

    def add(self, v: Verification) -> tuple[Verification, bool]:
        now = self.clock()
        values = {name: getattr(v, name) for name in _V_FIELDS}
        values.update(status=v.status.value, created_at=v.created_at or now, updated_at=now)
        try:
            with self.sessions.begin() as s:
                s.add(VerificationRow(**values))
        except IntegrityError:
            # decided already (a re-sent receipt, a racing sweep): the first decision stands
            return self.get(v.job_id), False
        return self.get(v.job_id), True

    def touch(self, job_id: str) -> None:
        with self.sessions.begin() as s:
            s.execute(update(VerificationRow).where(VerificationRow.job_id == job_id)
                      .values(updated_at=self.clock()))

    def open_for(self, provider_ids: list[str]) -> int:
        """How many checks of these providers' jobs are still open (checking, disputed)."""
        if not provider_ids:
            return 0
        with self.sessions() as s:
            return int(s.scalar(select(func.count()).select_from(VerificationRow).where(
                VerificationRow.provider_id.in_(provider_ids),
                VerificationRow.status.in_([s.value for s in OPEN_STATUSES]))) or 0)

    def get(self, job_id: str) -> Verification | None:
        with self.sessions() as s:
            row = s.get(VerificationRow, job_id)
            return _to_v(row) if row else None

    def by_check_job(self, check_job_id: str) -> Verification | None:
        with self.sessions() as s:
            row = s.scalars(select(VerificationRow).where(
                (VerificationRow.checker_job_id == check_job_id)
                | (VerificationRow.tiebreak_job_id == check_job_id))).first()
            return _to_v(row) if row else None

    def update(self, job_id: str, expect: set[CheckStatus], *, expect_tiebreak: str | None = None,
               expect_checker: str | None = None, expect_unjudged: bool = False,
               **fields) -> Verification | None:
        if "status" in fields:
            fields["status"] = CheckStatus(fields["status"]).value
        where = [VerificationRow.job_id == job_id,
                 VerificationRow.status.in_([e.value for e in expect])]
        if expect_tiebreak is not None:  # compare-and-set on the current third run
            where.append(VerificationRow.tiebreak_job_id == expect_tiebreak)
        if expect_checker is not None:  # compare-and-set on the current check run
            where.append(VerificationRow.checker_job_id == expect_checker)
        if expect_unjudged:  # no judgement stored yet (``outcome["applied"]`` unset)
            where.append(VerificationRow.outcome["applied"].as_boolean().is_(None))
        # Core on begin(): inside an ``atomic`` block (a check queued with its record) this
        # is part of the block's transaction, and the row is read back in it.
        with begin(self.sessions.kw["bind"]) as c:
            if c.execute(update(VerificationRow).where(*where)
                         .values(updated_at=self.clock(), **fields)).rowcount != 1:
                return None
            return _to_v(c.execute(select(VerificationRow.__table__)
                                   .where(VerificationRow.job_id == job_id)).one())

    def standing(self, provider_id: str, plugin: str, hardware_class: str) -> StandingRecord:
        with self.sessions() as s:
            row = s.get(StandingRow, (provider_id, plugin, hardware_class))
            return _to_s(row) if row else StandingRecord(provider_id, plugin, hardware_class)

    def record_check(self, provider_id: str, plugin: str, hardware_class: str, *, valid: bool,
                     quota_factor: float | None = None,
                     once: tuple[str, str] | None = None) -> StandingRecord:
        key = (provider_id, plugin, hardware_class)

        def change(row: StandingRow) -> StandingRecord:
            row.checks += 1
            if valid:
                row.consecutive_valid += 1
            else:
                row.consecutive_valid = 0
                row.failures += 1
                if quota_factor is not None:
                    row.quota_factor = max(MIN_QUOTA_FACTOR, row.quota_factor * quota_factor)
            return _to_s(row)
        return self._upsert(
            StandingRow, key,
            lambda: StandingRow(provider_id=provider_id, plugin=plugin,
                                hardware_class=hardware_class, consecutive_valid=0, checks=0,
                                failures=0, quota_factor=1.0),
            change, lambda row: _to_s(row) if row else StandingRecord(*key), "a check",
            once=once)

    def _upsert(self, model, key: tuple, fresh: Callable[[], Any],
                change: Callable[[Any], Any], as_is: Callable[[Any], Any], what: str, *,
                once: tuple[str, str] | None = None):
        """In one transaction: the row of ``model`` at ``key`` (``fresh()`` when there is
        none) locked and changed by ``change``, whose answer is returned. ``once``: step
        ``once[1]`` of record ``once[0]`` (``_first_time``, taken first: the record's row
        before this one, always in that order); when it is done already nothing changes and
        ``as_is(row or None)`` is returned. Two first writers racing to insert: the loser
        retries as an update."""
        for _ in range(5):
            try:
                with self.sessions.begin() as s:
                    if once is not None and not self._first_time(s, once):
                        return as_is(s.get(model, key))
                    row = s.get(model, key, with_for_update=True)
                    if row is None:
                        row = fresh()
                        s.add(row)
                    answer = change(row)
                    row.updated_at = self.clock()
                    s.flush()
                    return answer
            except IntegrityError:
                continue
        raise RuntimeError(f"could not record {what} for {key}")

    def _first_time(self, s: Session, once: tuple[str, str]) -> bool:
        """Whether step ``once[1]`` of record ``once[0]`` is not done yet (nor the record's
        effects all applied); if so it is marked done, in the caller's transaction."""
        v = s.get(VerificationRow, once[0], with_for_update=True)
        outcome = dict((v.outcome if v is not None else None) or {})
        done = list(outcome.get("done") or [])
        if once[1] in done or outcome.get("applied") is True:
            return False
        if v is not None:
            v.outcome = {**outcome, "done": [*done, once[1]]}
            v.updated_at = self.clock()
        return True

    def sampling_state(self, provider_id: str, plugin: str, witness: str) -> SamplingState:
        with self.sessions() as s:
            row = s.get(SamplingEvidenceRow, (provider_id, plugin, witness))
            return SamplingState(row.checks, row.log_s) if row else SamplingState()

    def add_sampling_evidence(self, provider_id: str, plugin: str, witness: str,
                              log_e: float, *,
                              once: tuple[str, str] | None = None) -> SamplingState:
        def change(row: SamplingEvidenceRow) -> SamplingState:
            state = SamplingState(row.checks, row.log_s).after(log_e)
            row.checks, row.log_s = state.checks, state.log_s
            return state
        return self._upsert(
            SamplingEvidenceRow, (provider_id, plugin, witness),
            lambda: SamplingEvidenceRow(provider_id=provider_id, plugin=plugin,
                                        witness=witness, checks=0, log_s=None),
            change, lambda row: SamplingState(row.checks, row.log_s) if row else SamplingState(),
            "sampled-text evidence", once=once)

    def close_sampling_evidence(self, provider_id: str, plugin: str, *,
                                once: tuple[str, str] | None = None) -> None:
        with self.sessions.begin() as s:
            if once is not None and not self._first_time(s, once):
                return
            s.execute(delete(SamplingEvidenceRow).where(
                SamplingEvidenceRow.provider_id == provider_id,
                SamplingEvidenceRow.plugin == plugin))

    def canary_outcome(self, provider_id: str, plugin: str, outcome: str,
                       window: int) -> str:
        if not 1 <= window <= 64:
            raise ValueError(f"window must be within 1..64 canaries: {window}")
        if outcome not in CANARY_OUTCOMES:
            raise ValueError(f"a canary's outcome is one of {sorted(CANARY_OUTCOMES)}: "
                             f"{outcome!r}")

        def change(row: CanaryMissRow) -> str:
            row.recent = (row.recent + outcome)[-window:]
            return row.recent
        return self._upsert(
            CanaryMissRow, (provider_id, plugin),
            lambda: CanaryMissRow(provider_id=provider_id, plugin=plugin, recent=""),
            change, lambda row: row.recent, "a canary outcome")

    def standings(self, provider_id: str) -> list[StandingRecord]:
        with self.sessions() as s:
            rows = s.scalars(select(StandingRow).where(StandingRow.provider_id == provider_id)
                             .order_by(StandingRow.plugin, StandingRow.hardware_class))
            return [_to_s(r) for r in rows]

    def quota_factor(self, provider_id: str) -> float:
        with self.sessions() as s:
            low = s.scalar(select(func.min(StandingRow.quota_factor))
                           .where(StandingRow.provider_id == provider_id))
            return 1.0 if low is None else float(low)

    def undecided(self, since: float, until: float, limit: int = 100) -> list[Job]:
        """Client jobs settled between ``since`` and ``until`` with no verification record
        (the broker stopped between a settlement and its sampling draw), read whole.
        ``ix_jobs_state_finished`` serves the range."""
        from .jobs_sql import _to_job
        from .models import JobRow

        with self.sessions() as s:
            rows = s.scalars(
                select(JobRow).outerjoin(VerificationRow, VerificationRow.job_id == JobRow.id)
                .where(JobRow.state == JobState.SETTLED.value, JobRow.check_of.is_(None),
                       JobRow.finished_at >= since, JobRow.finished_at < until,
                       VerificationRow.job_id.is_(None))
                .order_by(JobRow.finished_at).limit(limit))
            return [_to_job(r) for r in rows]

    def open_since(self, before: float, limit: int = 100, *,
                   queued_before: float | None = None) -> list[Verification]:
        """Checks still open (checking or disputed) last changed before ``before`` that
        the sweep may have to act on: those whose current run (the third run when disputed,
        else the check) is missing or has ended, or (with ``queued_before``) is still queued
        since before then. A run in progress, or queued since later, is left out, so that
        the oldest records of this window cannot keep the others out of it."""
        from .models import JobRow

        current = case((VerificationRow.status == CheckStatus.DISPUTED.value,
                        VerificationRow.tiebreak_job_id), else_=VerificationRow.checker_job_id)
        actionable = [JobRow.id.is_(None), JobRow.state.in_([t.value for t in TERMINAL])]
        if queued_before is not None:
            actionable.append(and_(JobRow.state == JobState.QUEUED.value,
                                   JobRow.created_at < queued_before))
        else:
            actionable.append(JobRow.state == JobState.QUEUED.value)
        with self.sessions() as s:
            rows = s.scalars(
                select(VerificationRow).outerjoin(JobRow, JobRow.id == current).where(
                    VerificationRow.status.in_([s.value for s in OPEN_STATUSES]),
                    VerificationRow.updated_at < before, or_(*actionable))
                .order_by(VerificationRow.updated_at).limit(limit))
            return [_to_v(r) for r in rows]

    def answers(self, key: str) -> dict[str, list[str]]:
        """The answers canary runs under ``key`` returned: answer -> operators."""
        with self.sessions() as s:
            return {r.answer: list(r.operators) for r in
                    s.scalars(select(CanaryAnswerRow).where(CanaryAnswerRow.key == key))}

    def add_answer(self, key: str, answer: str, operator: str) -> list[str]:
        """Record that ``operator`` returned ``answer``; the operators that did, after."""
        for _ in range(5):
            try:
                with self.sessions.begin() as s:
                    row = s.get(CanaryAnswerRow, (key, answer), with_for_update=True)
                    if row is None:
                        row = CanaryAnswerRow(key=key, answer=answer, operators=[],
                                              updated_at=self.clock())
                        s.add(row)
                    if operator not in row.operators:
                        row.operators = sorted([*row.operators, operator])
                        row.updated_at = self.clock()
                    s.flush()
                    return list(row.operators)
            except IntegrityError:
                continue
        raise RuntimeError(f"could not record a canary answer under {key}")

    def recent(self, limit: int = 100, status: CheckStatus | None = None) -> list[Verification]:
        with self.sessions() as s:
            q = select(VerificationRow)
            if status is not None:
                q = q.where(VerificationRow.status == status.value)
            rows = s.scalars(q.order_by(VerificationRow.updated_at.desc()).limit(limit))
            return [_to_v(r) for r in rows]
