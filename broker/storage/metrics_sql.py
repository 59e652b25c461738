"""What /metrics reads from the database: the facts every replica shares (the queue, jobs
in flight, ledger transactions, checks and disputes). One short read-only session, a few
grouped counts over indexed columns; see broker.observability.metrics for how often."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import sessionmaker

from broker.jobs.model import TERMINAL, JobState
from .admin_sql import DisputeRow
from .ledger_sql import LedgerTransactionRow
from .models import JobRow, ProviderRow
from .verification_sql import VerificationRow

_LIVE = sorted(s.value for s in JobState if s not in TERMINAL)


@dataclass
class DatabaseFacts:
    """One reading of the shared facts (``read_s``: what the reading cost)."""
    jobs: dict[tuple[str, str], int] = field(default_factory=dict)   # (state, plugin) live
    oldest_queued_at: dict[str, float] = field(default_factory=dict)  # plugin -> created_at
    ledger_transactions: dict[str, int] = field(default_factory=dict)  # kind -> count
    verifications: dict[tuple[str, str], int] = field(default_factory=dict)  # (status, plugin)
    disputes: dict[tuple[str, str], int] = field(default_factory=dict)  # (state, plugin)
    providers: dict[str, int] = field(default_factory=dict)            # status -> count
    read_s: float = 0.0


class SqlMetricsReader:
    def __init__(self, sessions: sessionmaker):
        self.sessions = sessions

    def read(self) -> DatabaseFacts:
        t0 = time.perf_counter()
        facts = DatabaseFacts()
        with self.sessions() as s:
            # Only jobs not yet ended: the (state, created_at) index answers it, however
            # many ended jobs the table holds. Ended jobs are counted as they end
            # (sparecycles_jobs_finished_total).
            for state, plugin, n in s.execute(
                    select(JobRow.state, JobRow.plugin, func.count())
                    .where(JobRow.state.in_(_LIVE)).group_by(JobRow.state, JobRow.plugin)):
                facts.jobs[(state, plugin)] = n
            for plugin, oldest in s.execute(
                    select(JobRow.plugin, func.min(JobRow.created_at))
                    .where(JobRow.state == "queued").group_by(JobRow.plugin)):
                facts.oldest_queued_at[plugin] = float(oldest)
            for kind, n in s.execute(select(LedgerTransactionRow.kind, func.count())
                                     .group_by(LedgerTransactionRow.kind)):
                facts.ledger_transactions[kind] = n
            for status, plugin, n in s.execute(
                    select(VerificationRow.status, VerificationRow.plugin, func.count())
                    .group_by(VerificationRow.status, VerificationRow.plugin)):
                facts.verifications[(status, plugin)] = n
            for state, plugin, n in s.execute(
                    select(DisputeRow.state, DisputeRow.plugin, func.count())
                    .group_by(DisputeRow.state, DisputeRow.plugin)):
                facts.disputes[(state, plugin)] = n
            for status, n in s.execute(select(ProviderRow.status, func.count())
                                       .group_by(ProviderRow.status)):
                facts.providers[status] = n
        facts.read_s = time.perf_counter() - t0
        return facts
