"""Tables of the broker (jobs, accounts, keys, providers). Times are epoch seconds."""
from __future__ import annotations

from sqlalchemy import (JSON, BigInteger, Boolean, Float, ForeignKey, Index, Integer, String, Text,
                        UniqueConstraint, false)
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base
from .sealed import SealedJSON, SealedText


class AccountRow(Base):
    __tablename__ = "accounts"
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    role: Mapped[str] = mapped_column(String(20))
    created_at: Mapped[float] = mapped_column(Float)


class ApiKeyRow(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # public key id
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    role: Mapped[str] = mapped_column(String(20))
    secret_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float)
    # May lie in the future: a rotated key works until then (its grace period).
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Space-separated scopes (broker/auth/scopes.py); "": every scope of the role.
    scopes: Mapped[str] = mapped_column(String(400), default="", server_default="")
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    name: Mapped[str] = mapped_column(String(200), default="", server_default="")


class ProviderRow(Base):
    __tablename__ = "providers"
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    public_key: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    status: Mapped[str] = mapped_column(String(20), default="active")  # active|paused|banned
    sandboxed: Mapped[bool] = mapped_column(Boolean, default=True)
    hardware: Mapped[dict] = mapped_column(JSON, default=dict)
    plugins: Mapped[list] = mapped_column(JSON, default=list)
    created_at: Mapped[float] = mapped_column(Float)
    last_seen_at: Mapped[float] = mapped_column(Float)
    # The broker replica holding the agent's stream now (None: not connected); believed
    # only while that replica's row in broker_replicas is fresh (issue #21).
    replica_id: Mapped[str | None] = mapped_column(String(100), nullable=True, index=True)
    availability: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # the agent's own word
    # The agent's latest telemetry (broker.observability.telemetry), and when it came.
    telemetry: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    telemetry_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class JobRow(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("account_id", "idempotency_key", name="uq_jobs_account_idem"),
        Index("ix_jobs_state_created", "state", "created_at"),
        Index("ix_jobs_state_finished", "state", "finished_at"),  # the verification sweep
        Index("ix_jobs_state_lease", "state", "lease_expires_at"),
        Index("ix_jobs_provider_state", "provider_id", "state"),
        Index("ix_jobs_cache_key", "cache_key", "state"),  # the result cache's look-up
    )
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"))
    plugin: Mapped[str] = mapped_column(String(64))
    plugin_version: Mapped[str] = mapped_column(String(64))
    inputs: Mapped[dict] = mapped_column(SealedJSON)  # the prompt: sealed at rest
    state: Mapped[str] = mapped_column(String(16))
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    provider_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    lease_expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    work_units: Mapped[float] = mapped_column(Float, default=0.0)
    progress_step: Mapped[int] = mapped_column(Integer, default=0)
    progress_total: Mapped[int] = mapped_column(Integer, default=0)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_message: Mapped[str | None] = mapped_column(SealedText, nullable=True)
    envelope: Mapped[dict | None] = mapped_column(SealedJSON, nullable=True)
    receipt: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    receipt_signature: Mapped[str | None] = mapped_column(String(128), nullable=True)
    excluded_providers: Mapped[list] = mapped_column(JSON, default=list)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True)
    request_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    matched_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    hold_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    max_price_micro: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    priority: Mapped[str] = mapped_column(String(16), default="standard",
                                          server_default="standard")
    deadline_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    price_micro_per_unit: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    batch_id: Mapped[str | None] = mapped_column(String(36), nullable=True, index=True)
    batch_index: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Verification (DESIGN §6): a check job names the job it re-runs; a check waits until
    # not_before; verify is the client's choice, "sampled" or "always" (two paid runs).
    check_of: Mapped[str | None] = mapped_column(String(36), nullable=True, index=True)
    not_before: Mapped[float | None] = mapped_column(Float, nullable=True)
    verify: Mapped[str] = mapped_column(String(12), default="sampled", server_default="sampled")
    weights_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # The X-Request-Id of the request that created the job (observability, issue #25).
    request_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # Issue #24 (migration 0014_s3_outputs): the output format asked for, the result cache.
    output_format: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    cache: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    cache_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    cached_from: Mapped[str | None] = mapped_column(String(36), nullable=True)


class JobEventRow(Base):
    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_id_id", "job_id", "id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    kind: Mapped[str] = mapped_column(String(32))
    data: Mapped[dict] = mapped_column(SealedJSON)  # streamed tokens, failure messages
    created_at: Mapped[float] = mapped_column(Float)


class JobOutputRow(Base):
    __tablename__ = "job_outputs"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64))
    media_type: Mapped[str] = mapped_column(String(100))
    size: Mapped[int] = mapped_column(Integer)


# ---- plugin and adapter registry (issue #3 marketplace; migration 0010_registry) ----------
class PublisherKeyRow(Base):
    """An Ed25519 key an account signs its published packages with."""
    __tablename__ = "publisher_keys"
    __table_args__ = (Index("ix_publisher_keys_account_id", "account_id"),)
    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    account_id: Mapped[str] = mapped_column(String(36))
    public_key: Mapped[str] = mapped_column(String(64), unique=True)
    label: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class RegistryPackageRow(Base):
    """One immutable published version of a plugin or adapter: the signed document."""
    __tablename__ = "registry_packages"
    __table_args__ = (Index("ix_registry_packages_base_plugin", "kind", "base_plugin"),)
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)   # plugin | adapter
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    version: Mapped[str] = mapped_column(String(64), primary_key=True)
    publisher_account: Mapped[str] = mapped_column(String(36))
    key_id: Mapped[str] = mapped_column(String(32))
    document: Mapped[str] = mapped_column(Text)          # canonical JSON, as signed
    signature: Mapped[str] = mapped_column(String(128))
    digest: Mapped[str] = mapped_column(String(64))      # sha256 of the canonical document
    base_plugin: Mapped[str | None] = mapped_column(String(64), nullable=True)
    royalty_micro: Mapped[int] = mapped_column(BigInteger)
    description: Mapped[str] = mapped_column(Text)
    published_at: Mapped[float] = mapped_column(Float)


class RegistryFileRow(Base):
    """A file of a published package, stored in the blob store under its sha256."""
    __tablename__ = "registry_files"
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    version: Mapped[str] = mapped_column(String(64), primary_key=True)
    path: Mapped[str] = mapped_column(String(400), primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(BigInteger)
    blob_key: Mapped[str] = mapped_column(String(400))


class StandingAskRow(Base):
    """A provider's last valid standing ask per plugin (DESIGN §4), so a broker restart or
    an agent reconnecting without re-posting keeps it. Sealed: read back only by the
    market, which shows it to its owner and admins."""
    __tablename__ = "standing_asks"
    provider_id: Mapped[str] = mapped_column(ForeignKey("providers.id"), primary_key=True)
    plugin: Mapped[str] = mapped_column(String(64), primary_key=True)
    price_micro_per_unit: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[float] = mapped_column(Float)


class MarketRuleRow(Base):
    """An admin-set rule of the market (``reputation_floor``), overriding the setting."""
    __tablename__ = "market_rules"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    updated_by: Mapped[str] = mapped_column(String(64))


class BrokerReplicaRow(Base):
    """A broker process serving on this database (issue #21): written at start, its
    ``seen_at`` refreshed every few seconds; a replica whose row went stale is dead, and
    the agent streams it held count as gone."""
    __tablename__ = "broker_replicas"
    id: Mapped[str] = mapped_column(String(100), primary_key=True)
    public_key: Mapped[str] = mapped_column(String(64))  # its signing key: replicas share one
    http: Mapped[str] = mapped_column(String(200), default="")
    grpc: Mapped[str] = mapped_column(String(200), default="")
    started_at: Mapped[float] = mapped_column(Float)
    seen_at: Mapped[float] = mapped_column(Float)


class AtRestKeyCheckRow(Base):
    """Which at-rest key this database is sealed with (one row): a keyed hash of a constant
    (``AtRestCipher.check_value``), never the key. Written by the first broker that seals
    here; a broker whose key gives another value is refused at start (broker/storage/sealed.py)."""
    __tablename__ = "at_rest_key_check"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)  # 1
    check_value: Mapped[str] = mapped_column(String(64))
    set_at: Mapped[float] = mapped_column(Float)


class ProviderThroughputRow(Base):
    """The broker's own figures of a provider for a plugin (DESIGN §4): measured θ, the
    claim beside it, successes and failures (reliability) and the last canary, so that a
    restart or another replica sees the same market."""
    __tablename__ = "provider_throughput"
    provider_id: Mapped[str] = mapped_column(ForeignKey("providers.id"), primary_key=True)
    plugin: Mapped[str] = mapped_column(String(64), primary_key=True)
    claimed_units_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    measured_units_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    samples: Mapped[int] = mapped_column(Integer, default=0)
    successes: Mapped[int] = mapped_column(Integer, default=0)
    failures: Mapped[int] = mapped_column(Integer, default=0)
    last_canary_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    updated_at: Mapped[float] = mapped_column(Float)
