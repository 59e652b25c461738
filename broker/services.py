"""Wiring: builds the storage, domain services and dispatcher from Settings.

This is the only module that knows which implementation backs which port.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field

from sqlalchemy.orm import sessionmaker

from sdk.protocol.signing import KeyPair

from broker.admin_wiring import audit_market_rules, audit_price_changes, build_admin
from broker.audit.money import AuditedLedger
from broker.audit.service import AuditLog
from broker.auth.service import ApiKeyService
from broker.billing.service import JobBilling
from broker.blobs import job_blob_store
from broker.blobs.retention import BlobRetention, RetentionPolicy
from broker.jobs.cache import ResultCache
from broker.blobs.local import LocalBlobStore
from broker.storage.sealed import open_at_rest
from broker.storage.sealed import attach as attach_at_rest
from broker.catalog.registry import PluginCatalog
from broker.jobs.dispatch import Dispatcher
from broker.jobs.presence import ProviderPresence
from broker.fault_tolerance import attach_checkpoints, stall_watch
from broker.jobs.hub import EventHub
from broker.jobs.model import SettledCopyCodec
from broker.jobs.service import JobService, JobSettings
from broker.ledger.service import LedgerService
from broker.links import LinkService, LinkSettings
from broker.maintenance import Maintenance
from broker.market import MarketService, MarketSettings
from broker.providers.defaults import WeightsDefaults
from broker.market.canary import CanaryService
from broker.market.elsewhere import MarketElsewhere
from broker.market.wiring import attach_market, manifests_of, terms_check
from broker.payments.service import PaymentService
from broker.pricing.service import PricingService
from broker.providers.presence import Presence
from broker.providers.service import ProviderService
from broker.registry.service import RegistryService
from broker.replicas import LocalBus, ReplicaBus
from broker.replicas.service import ReplicaRegistry
from broker.settings import Settings
from broker.storage.accounts_sql import SqlAccountRepository, SqlProviderRepository
from broker.storage.admin_sql import SqlAuditRepository
from broker.storage.base import make_engine
from broker.storage.jobs_sql import SqlJobRepository
from broker.storage.ledger_sql import SqlLedgerRepository
from broker.storage.links_sql import SqlLinkRepository
from broker.storage.market_sql import SqlAskStore
from broker.storage.payments_sql import SqlPaymentsRepository
from broker.storage.pricing_sql import SqlPriceRepository
from broker.storage.registry_sql import SqlRegistryRepository
from broker.storage.migrate import require_current, upgrade
from broker.storage.replicas_sql import SqlFigureStore, SqlReplicaStore
from broker.storage.notify_pg import bus_for
from broker.observability.metered import MeteredBlobStore, MeteredLedger
from broker.observability.metrics import BrokerMetrics
from broker.observability.telemetry import TelemetryStore
from broker.storage.metrics_sql import SqlMetricsReader
from broker.storage.retention_sql import SqlBlobReferences
from broker.storage.verification_sql import SqlVerificationRepository
from broker.verification.records import CheckStatus

log = logging.getLogger(__name__)


def shown_url(db_url: str) -> str:
    """The database URL as logs and messages show it (no password)."""
    from sqlalchemy.engine import make_url

    return make_url(db_url).render_as_string(hide_password=True)


@dataclass
class Services:
    settings: Settings
    engine: object
    signer: KeyPair
    auth: ApiKeyService
    catalog: PluginCatalog
    jobs: JobService
    providers: ProviderService
    dispatcher: Dispatcher
    ledger: LedgerService
    pricing: PricingService
    billing: JobBilling
    payments: PaymentService
    maintenance: Maintenance
    market: MarketService
    canaries: CanaryService
    registry: RegistryService               # the marketplace: publishers, packages, warm facts
    metrics: BrokerMetrics | None = None    # /metrics (broker.observability.metrics)
    telemetry: TelemetryStore | None = None  # agents' latest GPU/CPU reports, per provider
    audit: AuditLog | None = None           # hash-chained audit log (broker/audit)
    disputes: object | None = None          # broker.admin.disputes.DisputeService
    admin: object | None = None             # broker.admin.service.AdminService
    admin_sessions: object | None = None    # broker.admin.session.AdminSessions
    verification: object | None = None      # broker.verification.service.VerificationService
    links: LinkService | None = None        # operators linked by what the broker sees
    bus: ReplicaBus = field(default_factory=LocalBus)  # wake-ups to and from other replicas
    replicas: ReplicaRegistry | None = None  # the replicas serving on this database
    rate_limiter: object | None = None      # broker.ratelimit.RateLimiter (None: off)
    retention: BlobRetention | None = None  # what the blob store keeps, and for how long

    def stop(self) -> None:
        """Stop the threads that act on their own (the server stops its loop after this)."""
        self.maintenance.stop()
        self.dispatcher.stop()
        self.bus.close()
        if self.replicas is not None:
            self.replicas.stop()
        if self.verification is not None:
            self.verification.close()

    def dispose(self) -> None:
        """Write what is still in memory, then let the database go (after :meth:`stop`)."""
        self.market.flush_figures()  # what the last pass did not write yet
        self.engine.dispose()

    def close(self) -> None:
        self.stop()
        self.dispose()


def build_services(settings: Settings, *, migrate: bool | str = True,
                   record_new_key: bool = True) -> Services:
    """``migrate``: True upgrades the schema first (under an advisory lock on PostgreSQL);
    "auto" (``broker serve`` and the admin commands) upgrades an embedded SQLite database
    and refuses a PostgreSQL one that is behind, saying to run ``broker migrate``
    (NotMigrated); False neither upgrades nor checks. ``record_new_key``: whether an
    at-rest key file made now (no setting, no file yet) may be recorded as the one the
    database is sealed with (:func:`open_at_rest`); the one-off admin commands pass False."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(settings.db_url)
    if migrate == "auto" and engine.dialect.name == "postgresql":
        require_current(engine, shown_url(settings.db_url))
    elif migrate:
        upgrade(engine)
    # Prompts, envelopes, events, job blobs and wake-ups are sealed with this key
    # (broker/storage/sealed.py), checked against the one the database is sealed with.
    at_rest = open_at_rest(engine, settings.at_rest_key, settings.data_dir / "at_rest.key",
                           record_new=record_new_key)
    attach_at_rest(engine, at_rest)
    sessions = sessionmaker(engine, expire_on_commit=False)
    # Other replicas on the same PostgreSQL hear of jobs, queues and agent commands through
    # LISTEN/NOTIFY; on SQLite (one process) nobody else is there.
    bus = bus_for(settings.db_url, cipher=at_rest)
    signer = settings.signer()
    replicas = ReplicaRegistry(SqlReplicaStore(sessions), bus.replica_id, signer.public_key_hex)
    metrics = BrokerMetrics(replica=settings.replica_name or f"{socket.gethostname()}:{os.getpid()}",
                            version=_version(), db_reader=SqlMetricsReader(sessions),
                            db_interval_s=settings.metrics_db_interval_s)
    # Metrics off (bench/dispatch.py --metrics off): nothing on the hot path counts.
    counting = metrics if settings.metrics else None

    def blobs(store, name: str):
        return MeteredBlobStore(store, counting, name) if counting else store
    catalog = PluginCatalog.from_folders(settings.plugin_dirs)
    accounts = SqlAccountRepository(sessions)
    audit = AuditLog(SqlAuditRepository(sessions))
    # Operator links (issue #20): what the broker sees that ties two accounts to one person
    links = LinkService(SqlLinkRepository(sessions),
                        LinkSettings(link_loopback=settings.link_loopback), audit=audit)
    providers = ProviderService(SqlProviderRepository(sessions), links=links)
    telemetry = TelemetryStore(providers.repo, registry=metrics.registry)
    metrics.add_collector(telemetry.collect)
    ledger = LedgerService(SqlLedgerRepository(engine))
    ledger.open_platform_accounts()
    ledger = AuditedLedger(ledger, audit)  # every money movement lands in the audit log
    if counting:
        ledger = MeteredLedger(ledger, counting)  # postings and earnings in /metrics
    pricing = PricingService(SqlPriceRepository(sessions), bus=bus,
                             on_changed=audit_price_changes(audit))
    gateway = None
    if settings.stripe_secret_key:
        from broker.payments.stripe_gateway import StripeGateway

        gateway = StripeGateway(settings.stripe_secret_key, settings.stripe_webhook_secret or None,
                                api_base=settings.stripe_api_base or None)
    payments = PaymentService(ledger, SqlPaymentsRepository(sessions), gateway,
                              credit_price_cents=settings.credit_price_cents,
                              currency=settings.currency, public_url=settings.public_url,
                              account_exists=lambda a: accounts.get_account(a) is not None,
                              links=links)
    # The marketplace (issue #3): signed plugin/adapter versions, files in the blob store;
    # published plugins join the job catalog; adapter royalties are paid at settlement.
    registry = RegistryService(SqlRegistryRepository(sessions),
                               blobs(LocalBlobStore(settings.blob_dir / "registry"),
                                     "registry"),  # not job outputs
                               catalog, on_publisher=ledger.open_publisher)
    registry.load_catalog()
    billing = JobBilling(ledger, pricing, providers.owner_of, hold_ttl_s=settings.hold_ttl_s,
                         how_to_fund=payments.how_to_fund, royalty_of=registry.royalty_split)
    # Outputs and checkpoints: the local folder sealed with the at-rest key, or an S3
    # bucket agents upload to directly (its server-side encryption keeps them at rest).
    job_blobs = job_blob_store(settings, at_rest)
    retention = BlobRetention(job_blobs, SqlBlobReferences(sessions), RetentionPolicy(
        output_retention_s=settings.output_retention_s, orphan_grace_s=settings.orphan_grace_s,
        interval_s=settings.retention_interval_s))
    job_repo = SqlJobRepository(sessions)
    # The result cache answers only from verified jobs: it reads verification's records.
    verifications = SqlVerificationRepository(sessions)
    result_cache = ResultCache(job_repo, job_blobs, verified=lambda job_id: getattr(
        verifications.get(job_id), "status", None) == CheckStatus.VERIFIED,
        expired=retention.expired)
    reserve_of = lambda plugin: pricing.price(plugin).reserve_micro_per_unit  # noqa: E731
    market_settings = MarketSettings(claimed_throughput_factor=settings.market_claim_factor,
                                     canary_interval_s=settings.market_canary_interval_s,
                                     reputation_floor=settings.market_reputation_floor,
                                     default_cold_start_s=settings.market_cold_start_s)
    figures = SqlFigureStore(sessions)  # θ, reliability, canaries: outlive the process
    # The agents whose streams this replica holds: kept once, read by all (issue #21).
    # Which replica holds each stream is recorded in the replica registry as they come and
    # go; the streams the others hold are read back through it alone.
    held = ProviderPresence(streams=replicas)
    # Admission counts the providers other replicas hold (read from the database).
    elsewhere = MarketElsewhere(
        lambda: MarketService(reserve_of, market_settings, store=SqlAskStore(sessions),
                              manifest_of=manifests_of(catalog), linked_to=links.linked_to),
        held.held_elsewhere, providers.repo.many, figures) if bus.shared else None
    market = MarketService(reserve_of, market_settings, store=SqlAskStore(sessions),
                           manifest_of=manifests_of(catalog), linked_to=links.linked_to,
                           bus=bus, figures=figures, elsewhere=elsewhere,
                           # the cold-start term asks the registry's warm index whether the
                           # provider's plugin host has the model loaded (providers it has
                           # no report from count as warm)
                           warm=registry.warm.is_warm,
                           on_rule_changed=audit_market_rules(audit))
    # Whether anybody could run a build: the agents held here, and those any replica saw
    # within the window (no provider for a build: refuse, then expire; 0: never asked).
    presence = (Presence(providers.repo, held.serving, held.ids,
                         window_s=settings.unserved_expiry_s)
                if settings.unserved_expiry_s > 0 else None)
    jobs = JobService(job_repo, blobs(job_blobs, "jobs"), catalog, signer,
                      EventHub(bus, SettledCopyCodec()),
                      JobSettings(max_attempts=settings.max_attempts,
                                  lease_timeout_s=settings.lease_timeout_s,
                                  envelope_ttl_s=settings.envelope_ttl_s), billing=billing,
                      # the image size (and any input default_from = "weights") as the
                      # connected providers' weights give it; the gateway keeps it current
                      input_defaults=WeightsDefaults(
                          catalog, _held_plugins(held, providers) if bus.shared else None),
                      metrics=counting, retention=retention, result_cache=result_cache,
                      check_inputs=registry.check_job_adapters,  # another plugin's adapter: 422
                      # admission of a job's terms before any row or hold (CannotMeetTerms)
                      check_terms=terms_check(market),
                      on_failure=market.failed,  # the failures counted as the provider's
                      stalls=stall_watch(sessions, catalog, settings, market),
                      presence=presence)
    attach_checkpoints(jobs, sessions, settings)
    from broker.admin.session import load_or_create_secret

    # Exchanged API tokens are signed with a key derived from the console's secret, which
    # replicas share (SPARECYCLES_ADMIN_SESSION_SECRET) so a token works on any of them.
    console_secret = (settings.admin_session_secret
                      or load_or_create_secret(settings.admin_session_key_path))
    auth = ApiKeyService(accounts, token_secret=console_secret,
                         on_account_created=lambda account_id, role: _open_ledger_accounts(
                             ledger, account_id, role))
    providers.on_connected = lambda p: ledger.open_provider(p.account_id)
    canaries = CanaryService(market, catalog, signer, lease_timeout_s=settings.lease_timeout_s,
                             envelope_ttl_s=settings.envelope_ttl_s, extra=jobs.checkpoints,
                             linked_to=links.linked_to)
    # Lost disputes cut a provider's concurrency quota (verification's records hold it).
    dispatcher = Dispatcher(jobs, bus=bus, presence=held, market=market,
                            canary_sender=canaries.send_due,
                            needs_download=registry.warm.needs_download,
                            on_left=presence.left if presence is not None else None,
                            quota=verifications.quota_factor if settings.verification else None)
    attach_market(market, canaries, jobs)
    admin = build_admin(settings, sessions, secret=console_secret, audit=audit, pricing=pricing,
                        providers=providers, dispatcher=dispatcher, ledger=ledger,
                        payments=payments, jobs=jobs, catalog=catalog, auth=auth)
    maintenance = Maintenance(ledger, providers, interval_s=settings.maintenance_interval_s)
    maintenance.tasks.append(market.flush_figures)
    maintenance.tasks.append(retention.due)  # outputs, checkpoints and orphans expire
    if presence is not None:
        maintenance.tasks += [presence.refresh, jobs.expire_unserved]
    verification = None
    if settings.verification:
        verification = _attach_verification(settings, sessions, accounts, jobs, catalog, ledger,
                                            providers, admin, dispatcher, canaries, links)
        maintenance.tasks.append(verification.sweep)
    from broker.ratelimit import RateLimiter, parse_limits

    spec = parse_limits(settings.rate_limits)
    rate_limiter = RateLimiter(spec, settings.rate_limit_storage) if spec else None
    return Services(settings=settings, engine=engine, signer=signer, auth=auth, catalog=catalog,
                    rate_limiter=rate_limiter,
                    market=market, canaries=canaries, **admin, verification=verification,
                    jobs=jobs, providers=providers, dispatcher=dispatcher, ledger=ledger,
                    pricing=pricing, billing=billing, payments=payments, registry=registry,
                    maintenance=maintenance, links=links, bus=bus, replicas=replicas,
                    metrics=metrics, telemetry=telemetry, retention=retention)


def _attach_verification(settings, sessions, accounts, jobs, catalog, ledger, providers, admin,
                         dispatcher, canaries=None, links=None):
    """Spot redundancy (DESIGN §6): sample settled jobs for checks, judge them, and gate
    dispatch on minimum stake and the quota lost disputes cut."""
    import time as _time

    from broker.jobs.verification_port import JobsForVerification
    from broker.storage.verification_sql import SqlVerificationRepository
    from broker.verification.runs import CHECK_ACCOUNT
    from broker.verification.service import VerificationService, VerificationSettings

    if accounts.get_account(CHECK_ACCOUNT) is None:
        try:
            accounts.create_account(CHECK_ACCOUNT, "Verification checks (platform)", "client",
                                    _time.time())
        except Exception:  # noqa: BLE001 - another replica created it first
            if accounts.get_account(CHECK_ACCOUNT) is None:
                raise
    ledger.open_client(CHECK_ACCOUNT)
    repo = SqlVerificationRepository(sessions)
    verification = VerificationService(
        repo, JobsForVerification(jobs), catalog, ledger, providers, admin["admin"].policies,
        disputes=admin["disputes"], audit=admin["audit"], links=links,
        settings=VerificationSettings(check_delay_s=(0.0, max(0.0, settings.check_delay_max_s))))
    verification.judge_in_background()  # not on the agent stream that settled the check
    jobs.on_settled = verification.settled
    admin["disputes"].on_resolved = verification.admin_resolved
    if canaries is not None:  # canaries answer known inputs: each is a check too
        canaries.on_answer = verification.canary_answer
        canaries.on_unanswered = verification.canary_unanswered
    jobs.on_ended = verification.ended
    dispatcher.eligible = verification.stake_ok
    verification.on_quota = dispatcher.set_quota
    return verification


def _held_plugins(presence: ProviderPresence, providers: ProviderService):
    """provider id -> its stored plugins, for the streams other replicas hold."""
    def held() -> dict[str, list]:
        ids = list(presence.held_elsewhere())
        return {p.id: list(p.plugins or []) for p in providers.repo.many(ids)} if ids else {}
    return held


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sparecycles")
    except PackageNotFoundError:
        return ""


def _open_ledger_accounts(ledger: LedgerService, account_id: str, role: str) -> None:
    """Clients (and admins, who may submit jobs) get client accounts; providers get theirs
    when they create an account and again, idempotently, when an agent connects."""
    if role in ("client", "admin"):
        ledger.open_client(account_id)
    elif role == "provider":
        ledger.open_provider(account_id)
    elif role == "publisher":
        ledger.open_publisher(account_id)
