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
