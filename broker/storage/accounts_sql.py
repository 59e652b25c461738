"""SQL implementations of the account/key and provider repositories."""
from __future__ import annotations

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from broker.auth.service import KeyRecord
from broker.providers.model import Provider
from .models import AccountRow, ApiKeyRow, ProviderRow


class SqlAccountRepository:
    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions

    def create_account(self, account_id: str, name: str, role: str, now: float) -> None:
        with self.sessions.begin() as s:
            s.add(AccountRow(id=account_id, name=name, role=role, created_at=now))

    def get_account(self, account_id: str) -> tuple[str, str] | None:
        """(name, role) of an account, or None."""
        with self.sessions() as s:
            row = s.get(AccountRow, account_id)
            return (row.name, row.role) if row else None

    def add_key(self, record: KeyRecord, now: float) -> None:
        with self.sessions.begin() as s:
            s.add(ApiKeyRow(id=record.id, account_id=record.account_id, role=record.role,
                            secret_sha256=record.secret_sha256, created_at=now,
                            scopes=" ".join(record.scopes), expires_at=record.expires_at,
                            name=record.name[:200]))

    def get_key(self, key_id: str) -> KeyRecord | None:
        with self.sessions() as s:
            row = s.get(ApiKeyRow, key_id)
            return _key(row) if row is not None else None

    def list_keys(self, account_id: str | None = None) -> list[KeyRecord]:
        with self.sessions() as s:
            q = select(ApiKeyRow).order_by(ApiKeyRow.created_at, ApiKeyRow.id)
            if account_id is not None:
                q = q.where(ApiKeyRow.account_id == account_id)
            return [_key(r) for r in s.scalars(q)]

    def revoke_key(self, key_id: str, now: float) -> bool:
        """Revoked now (also a rotated key still in its grace period)."""
        with self.sessions.begin() as s:
            return s.execute(update(ApiKeyRow).where(
                ApiKeyRow.id == key_id,
                or_(ApiKeyRow.revoked_at.is_(None), ApiKeyRow.revoked_at > now))
                .values(revoked_at=now)).rowcount == 1

    def set_key_end(self, key_id: str, revoked_at: float) -> bool:
        """The key stops working at ``revoked_at`` (a rotation's grace), unless sooner."""
        with self.sessions.begin() as s:
            return s.execute(update(ApiKeyRow).where(
                ApiKeyRow.id == key_id,
                or_(ApiKeyRow.revoked_at.is_(None), ApiKeyRow.revoked_at > revoked_at))
                .values(revoked_at=revoked_at)).rowcount == 1


def _key(row: ApiKeyRow) -> KeyRecord:
    return KeyRecord(row.id, row.account_id, row.role, row.secret_sha256, row.revoked_at,
                     scopes=tuple((row.scopes or "").split()), expires_at=row.expires_at,
                     name=row.name or "", created_at=row.created_at)


def _provider(row: ProviderRow) -> Provider:
    return Provider(id=row.id, account_id=row.account_id, public_key=row.public_key,
                    name=row.name, status=row.status, sandboxed=row.sandboxed,
                    hardware=dict(row.hardware or {}), plugins=list(row.plugins or []),
                    created_at=row.created_at, last_seen_at=row.last_seen_at,
                    availability=dict(row.availability or {}),
                    telemetry=row.telemetry, telemetry_at=row.telemetry_at)


class SqlProviderRepository:
    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions

    def by_key(self, public_key: str) -> Provider | None:
        with self.sessions() as s:
            row = s.scalars(select(ProviderRow).where(ProviderRow.public_key == public_key)).first()
            return _provider(row) if row else None

    def get(self, provider_id: str) -> Provider | None:
        with self.sessions() as s:
            row = s.get(ProviderRow, provider_id)
            return _provider(row) if row else None

    def many(self, provider_ids: list[str]) -> list[Provider]:
        with self.sessions() as s:
            return [_provider(r) for r in s.scalars(
                select(ProviderRow).where(ProviderRow.id.in_(provider_ids)))]

    def add(self, p: Provider) -> None:
        with self.sessions.begin() as s:
            s.add(ProviderRow(id=p.id, account_id=p.account_id, public_key=p.public_key,
                              name=p.name, status=p.status, sandboxed=p.sandboxed,
                              hardware=p.hardware, plugins=p.plugins, created_at=p.created_at,
                              last_seen_at=p.last_seen_at))

    def update(self, provider_id: str, **fields) -> None:
        with self.sessions.begin() as s:
            s.execute(update(ProviderRow).where(ProviderRow.id == provider_id).values(**fields))

    def seen_since(self, t: float) -> list[Provider]:
        """Providers whose ``last_seen_at`` is ``t`` or later (broker.providers.presence)."""
        with self.sessions() as s:
            return [_provider(r) for r in s.scalars(
                select(ProviderRow).where(ProviderRow.last_seen_at >= t))]

    def touch(self, provider_ids: list[str], t: float) -> None:
        """Set ``last_seen_at`` of these providers to ``t`` (never back in time)."""
        with self.sessions.begin() as s:
            s.execute(update(ProviderRow).where(ProviderRow.id.in_(provider_ids),
                                                ProviderRow.last_seen_at < t)
                      .values(last_seen_at=t))
    def record_telemetry(self, provider_id: str, telemetry: dict, at: float) -> None:
        """Keep ``telemetry`` as the provider's latest (broker.observability.telemetry)."""
        with self.sessions.begin() as s:
            s.execute(update(ProviderRow).where(ProviderRow.id == provider_id)
                      .values(telemetry=telemetry, telemetry_at=at))

    def owners(self) -> list[str]:
        """The distinct accounts that own machines, sorted."""
        with self.sessions() as s:
            return list(s.scalars(select(ProviderRow.account_id).distinct()
                                  .order_by(ProviderRow.account_id)))

    def of_account(self, account_id: str) -> list[Provider]:
        with self.sessions() as s:
            return [_provider(r) for r in s.scalars(
                select(ProviderRow).where(ProviderRow.account_id == account_id)
                .order_by(ProviderRow.created_at))]

    def all(self) -> list[Provider]:
        with self.sessions() as s:
            return [_provider(r) for r in s.scalars(select(ProviderRow).order_by(ProviderRow.created_at))]
