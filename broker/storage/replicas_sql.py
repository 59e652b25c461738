"""The replica registry's and the market figures' tables (issue #21)."""
from __future__ import annotations

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session, sessionmaker

from .models import BrokerReplicaRow, ProviderRow, ProviderThroughputRow


class SqlReplicaStore:
    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions

    def join(self, replica_id: str, public_key: str, http: str, grpc: str, now: float) -> None:
        with self.sessions.begin() as s:
            s.merge(BrokerReplicaRow(id=replica_id, public_key=public_key, http=http[:200],
                                     grpc=grpc[:200], started_at=now, seen_at=now))

    def beat(self, replica_id: str, now: float) -> None:
        with self.sessions.begin() as s:
            s.execute(update(BrokerReplicaRow).where(BrokerReplicaRow.id == replica_id)
                      .values(seen_at=now))

    def leave(self, replica_id: str) -> None:
        with self.sessions.begin() as s:
            s.execute(update(ProviderRow).where(ProviderRow.replica_id == replica_id)
                      .values(replica_id=None))
            s.execute(delete(BrokerReplicaRow).where(BrokerReplicaRow.id == replica_id))

    def live(self, since: float) -> list[tuple[str, str, float]]:
        with self.sessions() as s:
            return [(r.id, r.public_key, r.seen_at) for r in s.scalars(
                select(BrokerReplicaRow).where(BrokerReplicaRow.seen_at >= since))]

    def bury(self, since: float) -> list[str]:
        with self.sessions.begin() as s:
            dead = list(s.scalars(select(BrokerReplicaRow.id)
                                  .where(BrokerReplicaRow.seen_at < since)))
            if dead:
                s.execute(update(ProviderRow).where(ProviderRow.replica_id.in_(dead))
                          .values(replica_id=None))
                s.execute(delete(BrokerReplicaRow).where(BrokerReplicaRow.id.in_(dead)))
            return dead

    def hold(self, provider_id: str, replica_id: str) -> None:
        with self.sessions.begin() as s:
            s.execute(update(ProviderRow).where(ProviderRow.id == provider_id)
                      .values(replica_id=replica_id))

    def release(self, provider_id: str, replica_id: str) -> None:
        with self.sessions.begin() as s:  # a newer stream on another replica stays
            s.execute(update(ProviderRow).where(ProviderRow.id == provider_id,
                                                ProviderRow.replica_id == replica_id)
                      .values(replica_id=None))

    def holders(self, since: float) -> dict[str, str]:
        with self.sessions() as s:
            rows = s.execute(select(ProviderRow.id, ProviderRow.replica_id)
                             .join(BrokerReplicaRow, BrokerReplicaRow.id == ProviderRow.replica_id)
                             .where(BrokerReplicaRow.seen_at >= since))
            return {pid: rid for pid, rid in rows}


class SqlFigureStore:
    """:class:`broker.market.figures.FigureStore` on the provider_throughput table."""

    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions

    def load_figures(self, provider_ids: list[str] | None = None):
        from broker.market.figures import Figures

        q = select(ProviderThroughputRow)
        if provider_ids is not None:
            q = q.where(ProviderThroughputRow.provider_id.in_(provider_ids))
        with self.sessions() as s:
            return [Figures(r.provider_id, r.plugin, r.claimed_units_per_s,
                            r.measured_units_per_s, r.samples, r.successes, r.failures,
                            r.last_canary_at) for r in s.scalars(q)]

    def save_figures(self, rows, at: float) -> None:
        with self.sessions.begin() as s:
            for f in rows:
                s.merge(ProviderThroughputRow(
                    provider_id=f.provider_id, plugin=f.plugin,
                    claimed_units_per_s=f.claimed_units_per_s,
                    measured_units_per_s=f.measured_units_per_s, samples=f.samples,
                    successes=f.successes, failures=f.failures,
                    last_canary_at=f.last_canary_at, updated_at=at))
