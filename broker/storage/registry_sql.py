"""SQL storage of the registry (:class:`broker.registry.service.RegistryRepository`)."""
from __future__ import annotations

import json

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from broker.registry.service import PackageRecord, PublisherKey, canonical_text
from .models import PublisherKeyRow, RegistryFileRow, RegistryPackageRow


def _key(row: PublisherKeyRow) -> PublisherKey:
    return PublisherKey(row.key_id, row.account_id, row.public_key, row.label, row.created_at,
                        row.revoked_at)


def _record(row: RegistryPackageRow) -> PackageRecord:
    """A stored package; its ``files`` stay empty (readers use ``document["files"]``)."""
    return PackageRecord(
        kind=row.kind, name=row.name, version=row.version,
        publisher_account=row.publisher_account, key_id=row.key_id,
        document=json.loads(row.document), signature=row.signature, digest=row.digest,
        base_plugin=row.base_plugin, royalty_micro=row.royalty_micro,
        description=row.description, published_at=row.published_at)


class SqlRegistryRepository:
    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions

    # ---- keys --------------------------------------------------------------------------
    def add_key(self, key: PublisherKey) -> None:
        with self.sessions.begin() as s:
            s.add(PublisherKeyRow(key_id=key.key_id, account_id=key.account_id,
                                  public_key=key.public_key, label=key.label,
                                  created_at=key.created_at, revoked_at=key.revoked_at))

    def key_by_public(self, public_key: str) -> PublisherKey | None:
        with self.sessions() as s:
            row = s.scalar(select(PublisherKeyRow).where(PublisherKeyRow.public_key == public_key))
            return _key(row) if row else None

    def keys_of(self, account_id: str) -> list[PublisherKey]:
        with self.sessions() as s:
            rows = s.scalars(select(PublisherKeyRow).where(PublisherKeyRow.account_id == account_id)
                             .order_by(PublisherKeyRow.created_at))
            return [_key(r) for r in rows]

    # ---- packages ----------------------------------------------------------------------
    def get(self, kind: str, name: str, version: str) -> PackageRecord | None:
        """One version (its files are read from the signed document; the file rows written
        at publish are not loaded)."""
        with self.sessions() as s:
            row = s.get(RegistryPackageRow, (kind, name, version))
            return _record(row) if row is not None else None

    def versions(self, kind: str, name: str) -> list[PackageRecord]:
        with self.sessions() as s:
            rows = s.scalars(select(RegistryPackageRow).where(
                RegistryPackageRow.kind == kind, RegistryPackageRow.name == name))
            return [_record(r) for r in rows]

    def all(self, kind: str) -> list[PackageRecord]:
        with self.sessions() as s:
            rows = s.scalars(select(RegistryPackageRow).where(RegistryPackageRow.kind == kind)
                             .order_by(RegistryPackageRow.name))
            return [_record(r) for r in rows]

    def add(self, record: PackageRecord) -> bool:
        """Insert a version with its files; False when that version already exists."""
        try:
            with self.sessions.begin() as s:
                s.add(RegistryPackageRow(
                    kind=record.kind, name=record.name, version=record.version,
                    publisher_account=record.publisher_account, key_id=record.key_id,
                    document=canonical_text(record.document), signature=record.signature,
                    digest=record.digest, base_plugin=record.base_plugin,
                    royalty_micro=record.royalty_micro, description=record.description,
                    published_at=record.published_at))
                s.flush()
                for f in record.files:
                    s.add(RegistryFileRow(kind=record.kind, name=record.name,
                                          version=record.version, path=f["path"],
                                          sha256=f["sha256"], size=f["size"],
                                          blob_key=f["blob_key"]))
            return True
        except IntegrityError:
            return False
