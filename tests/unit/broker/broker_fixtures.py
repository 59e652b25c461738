"""Builders for broker unit tests: a migrated database, services with a fake clock."""
from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy.orm import sessionmaker

from broker.auth.service import ApiKeyService
from broker.blobs.local import LocalBlobStore
from broker.catalog.registry import PluginCatalog
from broker.jobs.dispatch import Dispatcher
from broker.jobs.presence import AgentSession
from broker.jobs.service import JobService, JobSettings
from broker.settings import BUILTIN_PLUGINS
from broker.storage.accounts_sql import SqlAccountRepository
from broker.storage.base import make_engine
from broker.storage.jobs_sql import SqlJobRepository
from broker.storage.migrate import upgrade
from sdk.protocol.signing import KeyPair


class FakeClock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass(eq=False)
class RecordingSession(AgentSession):
    sent: list = field(default_factory=list)
    cancels: list = field(default_factory=list)

    def send_assignment(self, envelope_bytes, signature):
        self.sent.append((envelope_bytes, signature))

    def send_cancel(self, job_id, attempt, reason):
        self.cancels.append((job_id, attempt, reason))


def make_world(db_url: str, tmp_path, clock: FakeClock | None = None, max_attempts: int = 3):
    clock = clock or FakeClock()
    engine = make_engine(db_url)
    upgrade(engine)
    sessions = sessionmaker(engine, expire_on_commit=False)
    auth = ApiKeyService(SqlAccountRepository(sessions), clock=clock)
    signer = KeyPair.generate()
    jobs = JobService(SqlJobRepository(sessions, clock=clock), LocalBlobStore(tmp_path / "blobs"),
                      PluginCatalog.from_folders([BUILTIN_PLUGINS]), signer,
                      settings=JobSettings(max_attempts=max_attempts, lease_timeout_s=10),
                      clock=clock)
    return engine, auth, jobs, clock


def dispatcher_for(jobs: JobService, **options) -> Dispatcher:
    """A dispatcher placing ``jobs``' jobs: joined to the job service's events, as the
    wiring (broker/services.py) joins it."""
    d = Dispatcher(jobs, **options)
    jobs.job_events.join_placement(d)
    return d


def echo_world(tmp_path, slots: int = 1, db_url: str | None = None):
    """The real wiring (SQLite, or the database at ``db_url``) with one client, one provider whose agent (a
    RecordingSession of ``slots``) serves echo, echo priced at 1 + sleep_ms/1000 work units
    at 0.25 credit each with a 10 % fee and a 0.1 credit minimum: (services, client's
    principal, provider's principal, session, the agent's key). Dispose of
    ``services.engine`` when done."""
    from broker.services import build_services
    from broker.settings import Settings

    settings = Settings(data_dir=tmp_path, maintenance_interval_s=0,
                        **({"db_url": db_url} if db_url else {}))
    services = build_services(settings)
    _, client = services.auth.create_account_with_key("client")
    _, prov_acct = services.auth.create_account_with_key("provider")
    key = KeyPair.generate()
    provider = services.providers.connect(prov_acct, key.public_key_hex, "m1", sandboxed=True,
                                          hardware={}, plugins=[])
    session = RecordingSession(provider_id=provider.id, public_key=key.public_key_hex,
                               account_id=prov_acct.account_id, plugins={"echo@1.0.0": ""},
                               slots=slots)
    services.dispatcher.register(session)
    services.pricing.set_price("echo", {"reserve_micro_per_unit": 250_000, "fee_bps": 1_000,
                                        "min_charge_micro": 100_000, "vesting_window_s": 3600},
                               by="test")
    return services, client, prov_acct, session, key
