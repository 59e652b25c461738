"""SQL storage of the admin console: the audit chain, disputes, plugin policies, revoked
console sessions, and the read-only queries behind the console's pages."""
from __future__ import annotations

import statistics
import time
from datetime import datetime, timezone
from typing import Iterator

from sqlalchemy import (JSON, BigInteger, Float, Index, Integer, String, Text, bindparam, func,
                        insert, select, update)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from broker.admin.disputes import Dispute
from broker.audit.model import AuditEntry
from broker.jobs.model import JobState
from broker.pricing.policy import PluginPolicy
from .base import Base, atomic, begin, read_only
from .fast import Prepared, chunks
from .ledger_sql import LedgerAccountRow, LedgerHoldRow, LedgerIdempotencyRow, LedgerTransactionRow
from .models import AccountRow, JobEventRow, JobRow


class AuditRow(Base):
    __tablename__ = "audit_log"
    __table_args__ = (Index("ix_audit_log_subject_seq", "subject", "seq"),)
    seq: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                     autoincrement=False)
    at_ms: Mapped[int] = mapped_column(BigInteger)
    actor: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(64))
    subject: Mapped[str] = mapped_column(String(200))
    data: Mapped[str] = mapped_column(Text)  # canonical JSON, exactly as hashed
    ref: Mapped[str | None] = mapped_column(String(200), nullable=True, unique=True)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))


class DisputeRow(Base):
    __tablename__ = "disputes"
    __table_args__ = (Index("ix_disputes_state_opened_at", "state", "opened_at"),)
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    job_id: Mapped[str] = mapped_column(String(36), index=True)
    plugin: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))
    opened_at: Mapped[float] = mapped_column(Float)
    outcome: Mapped[str] = mapped_column(Text)
    sides: Mapped[list] = mapped_column(JSON)
    comparisons: Mapped[dict] = mapped_column(JSON)
    resolution: Mapped[dict | None] = mapped_column(JSON, nullable=True)


class PluginPolicyRow(Base):
    __tablename__ = "plugin_policies"
    plugin: Mapped[str] = mapped_column(String(64), primary_key=True)
    min_stake_micro: Mapped[int] = mapped_column(BigInteger)
    always_verify_above_micro: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[float] = mapped_column(Float)
    updated_by: Mapped[str] = mapped_column(String(64))


class AdminSessionRevocationRow(Base):
    __tablename__ = "admin_session_revocations"
    jti: Mapped[str] = mapped_column(String(64), primary_key=True)
    expires_at: Mapped[float] = mapped_column(Float)


# ---- audit ------------------------------------------------------------------------------
def _entry(r: AuditRow) -> AuditEntry:
    import json
    return AuditEntry(seq=r.seq, at_ms=r.at_ms, actor=r.actor, action=r.action, subject=r.subject,
                      data=json.loads(r.data), ref=r.ref, prev_hash=r.prev_hash, hash=r.hash)


AUDIT = AuditRow.__table__
# Built once (see broker/storage/jobs_sql.py): the append path runs on every money movement.
_AUDIT_HEAD = select(AUDIT).order_by(AUDIT.c.seq.desc()).limit(1)
# An append that finds its seq or its ref taken writes nothing (no error, so the
# transaction it is part of goes on): the log then re-reads the head or skips the replay.
_AUDIT_APPEND = {"sqlite": Prepared(sqlite_insert(AUDIT).on_conflict_do_nothing()),
                 "postgresql": Prepared(pg_insert(AUDIT).on_conflict_do_nothing())}
_AUDIT_HAS_REF = select(AUDIT.c.seq).where(AUDIT.c.ref == bindparam("w_ref"))
_AUDIT_COLUMNS = ("seq", "at_ms", "actor", "action", "subject", "data", "ref", "prev_hash",
                  "hash")
_AUDIT_APPENDS: dict[tuple[str, int], Prepared] = {}
_AUDIT_UNDO = Prepared(AUDIT.delete().where(AUDIT.c.seq.in_(bindparam("w_seqs",
                                                                      expanding=True))))


def _audit_append_rows(dialect: str, rows: int) -> Prepared:
    """One INSERT of ``rows`` entries (parameters ``w_<column><i>``) that skips those whose
    seq or ref exists and returns the seqs it inserted; built once per number of rows."""
    stmt = _AUDIT_APPENDS.get((dialect, rows))
    if stmt is None:
        maker = pg_insert if dialect == "postgresql" else sqlite_insert
        stmt = _AUDIT_APPENDS.setdefault((dialect, rows), Prepared(
            maker(AUDIT).values([{c: bindparam(f"w_{c}{i}", type_=AUDIT.c[c].type)
                                  for c in _AUDIT_COLUMNS} for i in range(rows)])
            .on_conflict_do_nothing().returning(AUDIT.c.seq)))
    return stmt


class SqlAuditRepository:
    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions
        self.engine = sessions.kw["bind"]

    def transaction(self):
        return atomic(self.engine)

    def head(self, conn=None) -> AuditEntry | None:
        if conn is not None:
            r = conn.execute(_AUDIT_HEAD).first()
            return _entry(r) if r else None
        with read_only(self.engine) as c:
            r = c.execute(_AUDIT_HEAD).first()
            return _entry(r) if r else None

    def append(self, conn, e: AuditEntry, data_json: str) -> bool:
        """Insert ``e`` in ``conn``'s transaction, its data as ``data_json`` (the canonical
        JSON its hash covers); False when its seq or ref exists."""
        return _AUDIT_APPEND[conn.dialect.name].run(conn, {
            "seq": e.seq, "at_ms": e.at_ms, "actor": e.actor, "action": e.action,
            "subject": e.subject, "data": data_json,
            "ref": e.ref, "prev_hash": e.prev_hash, "hash": e.hash}).rowcount == 1

    def append_many(self, conn, entries: list[AuditEntry], data_jsons: list[str]) -> bool:
        """Insert every entry of ``entries`` (a chain: each after the one before) in one
        statement, or none: False, writing nothing, when the seq or ref of one exists
        (the rows it did insert, this transaction's own, are deleted again: a chain with
        a gap must not commit). One append each where the database has no RETURNING."""
        if not conn.dialect.insert_returning:
            for i, (e, data_json) in enumerate(zip(entries, data_jsons)):
                if not self.append(conn, e, data_json):
                    if i:
                        _AUDIT_UNDO.run(conn, {"w_seqs": [x.seq for x in entries[:i]]})
                    return False
            return True
        inserted: list[int] = []
        pairs = list(zip(entries, data_jsons))
        for part in chunks(pairs, len(_AUDIT_COLUMNS)):  # under a statement's parameters
            params = {}
            for i, (e, data_json) in enumerate(part):
                params.update({f"w_seq{i}": e.seq, f"w_at_ms{i}": e.at_ms,
                               f"w_actor{i}": e.actor, f"w_action{i}": e.action,
                               f"w_subject{i}": e.subject, f"w_data{i}": data_json,
                               f"w_ref{i}": e.ref, f"w_prev_hash{i}": e.prev_hash,
                               f"w_hash{i}": e.hash})
            done = [r[0] for r in _audit_append_rows(conn.dialect.name, len(part))
                    .run(conn, params)]
            inserted += done
            if len(done) < len(part):
                break
        if len(inserted) == len(entries):
            return True
        for part in chunks(inserted, 1):
            _AUDIT_UNDO.run(conn, {"w_seqs": part})
        return False

    def has_ref(self, ref: str, conn=None) -> bool:
        if conn is not None:
            return conn.execute(_AUDIT_HAS_REF, {"w_ref": ref}).first() is not None
        with read_only(self.engine) as c:
            return c.execute(_AUDIT_HAS_REF, {"w_ref": ref}).first() is not None

    def scan(self, batch: int = 1000) -> Iterator[AuditEntry]:
        after = 0
        while True:
            with self.sessions() as s:
                rows = [_entry(r) for r in s.scalars(select(AuditRow).where(AuditRow.seq > after)
                                                     .order_by(AuditRow.seq).limit(batch))]
            yield from rows
            if len(rows) < batch:
                return
            after = rows[-1].seq

    def search(self, *, subject=None, action=None, before_seq=None, limit=100) -> list[AuditEntry]:
        q = select(AuditRow).order_by(AuditRow.seq.desc()).limit(limit)
        if subject:
            q = q.where(AuditRow.subject.like(subject[:-1] + "%") if subject.endswith("*")
                        else AuditRow.subject == subject)
        if action:
            q = q.where(AuditRow.action.like(action + "%"))
        if before_seq is not None:
            q = q.where(AuditRow.seq < before_seq)
        with self.sessions() as s:
            return [_entry(r) for r in s.scalars(q)]


# ---- disputes ---------------------------------------------------------------------------
def _dispute(r: DisputeRow) -> Dispute:
    return Dispute(id=r.id, job_id=r.job_id, plugin=r.plugin, state=r.state, opened_at=r.opened_at,
                   outcome=r.outcome, sides=list(r.sides or []), comparisons=dict(r.comparisons or {}),
                   resolution=r.resolution)


class SqlDisputeRepository:
    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions

    def add(self, d: Dispute) -> None:
        # Core on begin(): verification opens a dispute in one transaction with the mark
        # that says it did (broker/verification/service.py, _apply).
        with begin(self.sessions.kw["bind"]) as c:
            c.execute(insert(DisputeRow.__table__).values(
                id=d.id, job_id=d.job_id, plugin=d.plugin, state=d.state,
                opened_at=d.opened_at, outcome=d.outcome, sides=d.sides,
                comparisons=d.comparisons, resolution=d.resolution))

    def get(self, dispute_id: str) -> Dispute | None:
        with self.sessions() as s:
            r = s.get(DisputeRow, dispute_id)
            return _dispute(r) if r else None

    def list(self, state: str | None = None, limit: int = 100) -> list[Dispute]:
        q = select(DisputeRow).order_by(DisputeRow.opened_at.desc()).limit(limit)
        if state:
            q = q.where(DisputeRow.state == state)
        with self.sessions() as s:
            return [_dispute(r) for r in s.scalars(q)]

    def resolve(self, dispute_id: str, resolution: dict) -> bool:
        """Resolve an open dispute; False when it is not open (resolved by someone else)."""
        with self.sessions.begin() as s:
            return s.execute(update(DisputeRow).where(DisputeRow.id == dispute_id,
                                                      DisputeRow.state == "open")
                             .values(state="resolved", resolution=resolution)).rowcount == 1


# ---- policies ---------------------------------------------------------------------------
class SqlPolicyRepository:
    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions

    def get(self, plugin: str) -> PluginPolicy | None:
        with self.sessions() as s:
            r = s.get(PluginPolicyRow, plugin)
            return PluginPolicy(r.plugin, r.min_stake_micro, r.always_verify_above_micro,
                                r.updated_at, r.updated_by) if r else None

    def put(self, p: PluginPolicy) -> None:
        with self.sessions.begin() as s:
            s.merge(PluginPolicyRow(plugin=p.plugin, min_stake_micro=p.min_stake_micro,
                                    always_verify_above_micro=p.always_verify_above_micro,
                                    updated_at=p.updated_at, updated_by=p.updated_by))


# ---- console sessions -------------------------------------------------------------------
class SqlSessionRevocations:
    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions

    def revoke(self, jti: str, expires_at: float) -> None:
        with self.sessions.begin() as s:
            s.merge(AdminSessionRevocationRow(jti=jti, expires_at=expires_at))
            s.query(AdminSessionRevocationRow).filter(
                AdminSessionRevocationRow.expires_at < time.time() - 60).delete()

    def is_revoked(self, jti: str) -> bool:
        with self.sessions() as s:
            return s.get(AdminSessionRevocationRow, jti) is not None


# ---- read model -------------------------------------------------------------------------
def _epoch(dt: datetime | None) -> float | None:
    if dt is None:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


class SqlAdminQueries:
    """What the console reads that no domain service exposes: searches across accounts,
    time series and whole-ledger listings. Read-only."""

    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions

    def search_jobs(self, *, job_id=None, client=None, provider=None, plugin=None, state=None,
                    since=None, until=None, limit=100) -> list[JobRow]:
        q = select(JobRow).order_by(JobRow.created_at.desc()).limit(limit)
        if job_id:
            q = q.where(JobRow.id.like(job_id.strip() + "%"))
        if client:
            q = q.where(JobRow.account_id.like(client.strip() + "%"))
        if provider:
            q = q.where(JobRow.provider_id.like(provider.strip() + "%"))
        if plugin:
            q = q.where(JobRow.plugin == plugin)
        if state:
            q = q.where(JobRow.state == state)
        if since is not None:
            q = q.where(JobRow.created_at >= since)
        if until is not None:
            q = q.where(JobRow.created_at < until)
        with self.sessions() as s:
            rows = list(s.scalars(q))
            s.expunge_all()
            return rows

    def provider_stats(self, provider_id: str) -> dict:
        with self.sessions() as s:
            rows = list(s.execute(select(JobRow.state, JobRow.work_units)
                                  .where(JobRow.provider_id == provider_id)))
        done = sum(1 for st, _ in rows if st == JobState.SETTLED.value)
        failed = sum(1 for st, _ in rows if st == JobState.FAILED.value)
        return {"jobs": len(rows), "settled": done, "failed": failed,
                "reliability": (done / (done + failed)) if done + failed else None}

    def provider_jobs(self, provider_ids: list[str], *, since: float) -> dict[str, dict]:
        """Per provider (broker.providers.overview): jobs settled and failed since
        ``since``, jobs given back since then, and its unsettled jobs (leased, submitted,
        being verified, disputed) with what pricing them needs."""
        unsettled_states = [JobState.MATCHED.value, JobState.RUNNING.value,
                            JobState.SUBMITTED.value, JobState.VERIFYING.value,
                            JobState.DISPUTED.value]
        out: dict[str, dict] = {pid: {"settled_today": 0, "failed_today": 0,
                                      "given_back_today": 0, "unsettled": []}
                                for pid in provider_ids}
        with self.sessions() as s:
            for pid, state, n in s.execute(
                    select(JobRow.provider_id, JobRow.state, func.count())
                    .where(JobRow.provider_id.in_(provider_ids),
                           JobRow.state.in_([JobState.SETTLED.value, JobState.FAILED.value]),
                           JobRow.finished_at >= since)
                    .group_by(JobRow.provider_id, JobRow.state)):
                key = "settled_today" if state == JobState.SETTLED.value else "failed_today"
                out[pid][key] = int(n)
            for row in s.execute(
                    select(JobRow.provider_id, JobRow.state, JobRow.plugin,
                           JobRow.price_micro_per_unit, JobRow.work_units, JobRow.max_price_micro)
                    .where(JobRow.provider_id.in_(provider_ids),
                           JobRow.state.in_(unsettled_states))):
                out[row[0]]["unsettled"].append(
                    {"state": row[1], "plugin": row[2], "price_micro_per_unit": row[3],
                     "work_units": row[4], "max_price_micro": row[5]})
            for data in s.scalars(select(JobEventRow.data).where(
                    JobEventRow.kind == "requeued", JobEventRow.created_at >= since)):
                pid = (data or {}).get("provider_id")
                if pid in out and (data or {}).get("why") == "given_back":
                    out[pid]["given_back_today"] += 1
        return out

    def account_names(self, ids: list[str]) -> dict[str, str]:
        if not ids:
            return {}
        with self.sessions() as s:
            return {r.id: r.name for r in s.scalars(select(AccountRow).where(AccountRow.id.in_(ids)))}

    def series(self, *, window_s: int = 3600, bucket_s: int = 60, now: float | None = None) -> dict:
        """Per-bucket figures over the last ``window_s``: jobs created and finished, queue
        depth at the bucket's end, median wait (created → matched) and run (matched →
        finished) of the jobs that finished in it, credits spent (captured) and earned."""
        now = time.time() if now is None else now
        start = now - window_s
        n = max(1, window_s // bucket_s)
        buckets = [{"t": start + (i + 1) * bucket_s, "created": 0, "finished": 0, "queue": 0,
                    "waits": [], "runs": [], "spent_micro": 0, "earned_micro": 0, "fees_micro": 0}
                   for i in range(n)]

        def at(t):
            i = int((t - start) // bucket_s)
            return buckets[i] if 0 <= i < n else None

        with self.sessions() as s:
            jobs = list(s.execute(select(JobRow.created_at, JobRow.matched_at, JobRow.finished_at,
                                         JobRow.state).where(
                (JobRow.finished_at.is_(None)) | (JobRow.finished_at >= start))))
            holds = list(s.execute(select(LedgerHoldRow.resolved_at, LedgerHoldRow.captured_micro,
                                          LedgerHoldRow.provider_micro, LedgerHoldRow.fee_micro)
                                   .where(LedgerHoldRow.state == "posted")))
        for created, matched, finished, state in jobs:
            b = at(created)
            if b:
                b["created"] += 1
            if finished is not None and (b := at(finished)):
                b["finished"] += 1
                if matched is not None:
                    b["waits"].append(matched - created)
                    b["runs"].append(finished - matched)
            for bk in buckets:  # queued at the bucket's end
                if created <= bk["t"] and (matched is None or matched > bk["t"]) and \
                        (finished is None or finished > bk["t"]):
                    bk["queue"] += 1
        for resolved, captured, earned, fee in holds:
            b = at(_epoch(resolved) or 0)
            if b:
                b["spent_micro"] += captured
                b["earned_micro"] += earned
                b["fees_micro"] += fee
        all_waits = [w for b in buckets for w in b["waits"]]
        all_runs = [r for b in buckets for r in b["runs"]]
        for b in buckets:
            b["median_wait_s"] = statistics.median(b["waits"]) if b["waits"] else None
            b["median_run_s"] = statistics.median(b["runs"]) if b["runs"] else None
            del b["waits"], b["runs"]
        return {"buckets": buckets, "bucket_s": bucket_s,
                "median_wait_s": statistics.median(all_waits) if all_waits else None,
                "median_run_s": statistics.median(all_runs) if all_runs else None}

    def ledger_accounts(self, *, owner=None, kind=None, limit=500) -> list[dict]:
        q = select(LedgerAccountRow).order_by(LedgerAccountRow.kind, LedgerAccountRow.owner_id).limit(limit)
        if owner:
            q = q.where(LedgerAccountRow.owner_id.like(owner.strip() + "%"))
        if kind:
            q = q.where(LedgerAccountRow.kind == kind)
        with self.sessions() as s:
            return [{"id": r.id, "kind": r.kind, "owner": r.owner_id,
                     "balance_micro": r.balance_micro} for r in s.scalars(q)]

    def stripe_events(self, limit=100) -> list[dict]:
        """Stripe payments the ledger applied (keys ``stripe:<session>``, deduplicated)."""
        with self.sessions() as s:
            rows = list(s.execute(
                select(LedgerIdempotencyRow.key, LedgerIdempotencyRow.result_id,
                       LedgerIdempotencyRow.created_at, LedgerTransactionRow.memo)
                .join(LedgerTransactionRow, LedgerTransactionRow.id == LedgerIdempotencyRow.result_id)
                .where(LedgerIdempotencyRow.key.like("stripe:%"))
                .order_by(LedgerIdempotencyRow.created_at.desc()).limit(limit)))
        return [{"key": k, "transaction": t, "at": _epoch(c), "memo": m} for k, t, c, m in rows]

    def transactions(self, limit=50) -> list[dict]:
        with self.sessions() as s:
            rows = list(s.scalars(select(LedgerTransactionRow)
                                  .order_by(LedgerTransactionRow.created_at.desc()).limit(limit)))
        return [{"id": r.id, "kind": r.kind, "at": _epoch(r.created_at), "memo": r.memo,
                 "hold": r.hold_id} for r in rows]

    def payouts(self, limit=100) -> list[dict]:
        from .payments_sql import PayoutRow
        with self.sessions() as s:
            rows = list(s.scalars(select(PayoutRow).order_by(PayoutRow.created_at.desc()).limit(limit)))
        return [{"id": r.id, "owner": r.owner_id, "amount_micro": r.amount_micro,
                 "amount_cents": r.amount_cents, "currency": r.currency, "status": r.status,
                 "transfer": r.transfer_id, "error": r.error, "at": r.created_at} for r in rows]

    # ---- verification (read-only; DESIGN §6) -------------------------------------------
    def verification_statuses(self, job_ids: list[str]) -> dict[str, str]:
        """The verification status of each listed client job that has a record."""
        from .verification_sql import VerificationRow
        if not job_ids:
            return {}
        with self.sessions() as s:
            return dict(s.execute(select(VerificationRow.job_id, VerificationRow.status)
                                  .where(VerificationRow.job_id.in_(list(job_ids)))).all())

    def check_roles(self, check_job_ids: list[str]) -> dict[str, tuple[str, str]]:
        """For check jobs: ``{check job id: (checked client job id, "checker" | "tiebreaker")}``."""
        from .verification_sql import VerificationRow
        ids = [i for i in check_job_ids if i]
        if not ids:
            return {}
        out: dict[str, tuple[str, str]] = {}
        with self.sessions() as s:
            for job_id, checker, tiebreak in s.execute(
                    select(VerificationRow.job_id, VerificationRow.checker_job_id,
                           VerificationRow.tiebreak_job_id)
                    .where(VerificationRow.checker_job_id.in_(ids)
                           | VerificationRow.tiebreak_job_id.in_(ids))):
                if checker in ids:
                    out[checker] = (job_id, "checker")
                if tiebreak in ids:
                    out[tiebreak] = (job_id, "tiebreaker")
        return out

    def standing_summary(self) -> dict[str, dict]:
        """Per provider, over its (plugin, hardware class) standings: the lowest CV, the
        checks and failures summed, and the lowest quota factor."""
        from sqlalchemy import func
        from .verification_sql import StandingRow
        with self.sessions() as s:
            rows = s.execute(select(StandingRow.provider_id,
                                    func.min(StandingRow.consecutive_valid),
                                    func.sum(StandingRow.checks), func.sum(StandingRow.failures),
                                    func.min(StandingRow.quota_factor), func.count())
                             .group_by(StandingRow.provider_id)).all()
        return {pid: {"cv_min": int(cv), "checks": int(checks or 0),
                      "failures": int(failures or 0), "quota_factor": float(quota),
                      "classes": int(n)}
                for pid, cv, checks, failures, quota, n in rows}

    def verification_summary(self, since: float) -> dict:
        """Checks and client jobs created since ``since`` and in all; verification records
        by status (all, and those that reached it since ``since``); disagreements that went
        to a third run (``tiebreaks_*``: the 2-of-3 disputes)."""
        from sqlalchemy import func
        from .verification_sql import VerificationRow
        is_check = JobRow.check_of.is_not(None)
        with self.sessions() as s:
            def count(*where):
                return int(s.scalar(select(func.count()).select_from(JobRow).where(*where)) or 0)
            out = {"checks_recent": count(is_check, JobRow.created_at >= since),
                   "client_jobs_recent": count(JobRow.check_of.is_(None),
                                               JobRow.created_at >= since),
                   "checks_total": count(is_check),
                   "client_jobs_total": count(JobRow.check_of.is_(None))}
            tiebreak = VerificationRow.tiebreak_job_id.is_not(None)
            out["tiebreaks_recent"] = int(s.scalar(select(func.count()).select_from(
                VerificationRow).where(tiebreak, VerificationRow.updated_at >= since)) or 0)
            out["tiebreaks_total"] = int(s.scalar(select(func.count()).select_from(
                VerificationRow).where(tiebreak)) or 0)
            out["by_status"] = dict(s.execute(
                select(VerificationRow.status, func.count()).group_by(VerificationRow.status)).all())
            out["by_status_recent"] = dict(s.execute(
                select(VerificationRow.status, func.count())
                .where(VerificationRow.updated_at >= since)
                .group_by(VerificationRow.status)).all())
        return out

    def provider_earnings(self, provider_id: str) -> dict:
        """What the provider's settled jobs paid it (its share of posted holds), and what
        verification took back (refunded holds)."""
        with self.sessions() as s:
            rows = s.execute(select(LedgerHoldRow.provider_micro,
                                    LedgerHoldRow.refund_transaction_id,
                                    LedgerHoldRow.vest_transaction_id)
                             .join(JobRow, JobRow.hold_id == LedgerHoldRow.id)
                             .where(JobRow.provider_id == provider_id,
                                    LedgerHoldRow.state == "posted")).all()
        kept = [m for m, refund, _ in rows if refund is None]
        return {"earned_micro": sum(kept), "jobs_paid": len(kept),
                "vested_micro": sum(m for m, refund, vest in rows if refund is None and vest),
                "refunded_micro": sum(m for m, refund, _ in rows if refund is not None),
                "jobs_refunded": sum(1 for _, refund, _ in rows if refund is not None)}
