"""Wiring: builds the storage, domain services and dispatcher from Settings.

This is the only module that knows which implementation backs which port.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.orm import sessionmaker

from sdk.protocol.signing import KeyPair

from broker.auth.service import ApiKeyService
from broker.blobs.local import LocalBlobStore
from broker.catalog.registry import PluginCatalog
from broker.jobs.dispatch import Dispatcher
from broker.jobs.hub import EventHub
from broker.jobs.service import JobService, JobSettings
from broker.providers.service import ProviderService
from broker.settings import Settings
from broker.storage.accounts_sql import SqlAccountRepository, SqlProviderRepository
from broker.storage.base import make_engine
from broker.storage.jobs_sql import SqlJobRepository
from broker.storage.migrate import upgrade

log = logging.getLogger(__name__)


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

    def close(self) -> None:
        self.dispatcher.stop()
        self.engine.dispose()


def build_services(settings: Settings, *, migrate: bool = True) -> Services:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(settings.db_url)
    if migrate:
        upgrade(engine)
    sessions = sessionmaker(engine, expire_on_commit=False)
    signer = KeyPair.load_or_create(settings.key_path)
    catalog = PluginCatalog.from_folders(settings.plugin_dirs)
    jobs = JobService(SqlJobRepository(sessions), LocalBlobStore(settings.blob_dir), catalog,
                      signer, EventHub(),
                      JobSettings(max_attempts=settings.max_attempts,
                                  lease_timeout_s=settings.lease_timeout_s,
                                  envelope_ttl_s=settings.envelope_ttl_s))
    return Services(settings=settings, engine=engine, signer=signer,
                    auth=ApiKeyService(SqlAccountRepository(sessions)), catalog=catalog,
                    jobs=jobs, providers=ProviderService(SqlProviderRepository(sessions)),
                    dispatcher=Dispatcher(jobs))
