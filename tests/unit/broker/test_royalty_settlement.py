"""Adapter royalties at settlement (issue #5), on SQLite and PostgreSQL: the hold is divided
provider share → royalty → platform fee → rest released, to the micro-credit."""
import time
from fractions import Fraction

import pytest
from sqlalchemy.orm import sessionmaker

from broker.auth.service import Principal
from broker.billing.service import JobBilling
from broker.blobs.local import LocalBlobStore
from broker.catalog.registry import PluginCatalog
from broker.jobs.model import Job, JobState
from broker.ledger.model import AccountId, AccountKind, FundingSource
from broker.ledger.service import LedgerService
from broker.pricing.service import PricingService
from broker.registry.service import RegistryService
from broker.settings import BUILTIN_PLUGINS
from broker.storage.base import make_engine
from broker.storage.ledger_sql import SqlLedgerRepository
from broker.storage.migrate import upgrade
from broker.storage.pricing_sql import SqlPriceRepository
from broker.storage.registry_sql import SqlRegistryRepository

from tests.marketplace_helpers import adapter_folder, publish, register

PUBLISHER = Principal("acct-pub", "publisher", "k1")
CLIENT, PROVIDER_ACCOUNT = "acct-client", "acct-provider"


@pytest.fixture
def money(db_url, tmp_path):
    engine = make_engine(db_url)
    upgrade(engine)
    sessions = sessionmaker(engine, expire_on_commit=False)
    ledger = LedgerService(SqlLedgerRepository(engine))
    ledger.open_platform_accounts()
    ledger.open_client(CLIENT)
    ledger.deposit(CLIENT, 10_000_000, idempotency_key="grant", source=FundingSource.DEV_GRANT)
    pricing = PricingService(SqlPriceRepository(sessions))
    # sd15 at 10,000 micro-credits per work unit, 10 % fee, no minimum
    pricing.set_price("sd15", {"reserve_micro_per_unit": 10_000, "fee_bps": 1_000,
                               "min_charge_micro": 0, "vesting_window_s": 3600}, by="test")
    # No on_publisher hook here: billing must open the royalties account itself.
    registry = RegistryService(SqlRegistryRepository(sessions), LocalBlobStore(tmp_path / "b"),
                               PluginCatalog.from_folders([BUILTIN_PLUGINS]))
    keys = register(registry, PUBLISHER)
    publish(registry, PUBLISHER, keys, adapter_folder(tmp_path, name="ink", royalty=250_000))
    publish(registry, PUBLISHER, keys, adapter_folder(tmp_path, name="film", royalty=0))
    billing = JobBilling(ledger, pricing, lambda provider_id: PROVIDER_ACCOUNT,
                         royalty_of=registry.royalty_split)
    yield ledger, billing
    engine.dispose()


def _job(billing, job_id: str, adapters: str, rate: int | None) -> Job:
    hold_id, amount = billing.hold(job_id, CLIENT, "sd15", 100.0)  # 100 units: 1,000,000
    return Job(id=job_id, account_id=CLIENT, plugin="sd15", plugin_version="1.0.0",
               inputs={"prompt": "a lighthouse", "adapters": adapters}, state=JobState.SETTLED,
               provider_id="machine-1", work_units=100.0, hold_id=hold_id,
               max_price_micro=amount, price_micro_per_unit=rate, created_at=time.time())


def _balances(ledger):
    return (ledger.balance(AccountId(AccountKind.CLIENT_AVAILABLE, CLIENT)),
            ledger.balance(AccountId(AccountKind.PROVIDER_VESTING, PROVIDER_ACCOUNT)),
            ledger.balances(PUBLISHER.account_id).get(AccountKind.PUBLISHER_ROYALTIES, 0),
            ledger.balance(AccountId.platform(AccountKind.PLATFORM_FEES)))


def test_royalty_is_paid_to_the_publisher_within_the_hold(money):
    ledger, billing = money
    job = _job(billing, "job-1", "ink:0.8", rate=6_000)
    assert job.max_price_micro == 1_000_000
    txn = billing.settle(job, "100")
    # charge 600,000 = provider 540,000 + fee 60,000; royalty 250,000; released 150,000
    assert _balances(ledger) == (10_000_000 - 850_000, 540_000, 250_000, 60_000)
    hold = ledger.get_hold(job.hold_id)
    assert (hold.publisher, hold.royalty_micro, hold.released_micro) == (
        PUBLISHER.account_id, 250_000, 150_000)
    # a re-sent receipt settles nothing twice
    assert billing.settle(job, "100").id == txn.id
    assert _balances(ledger)[2] == 250_000
    assert ledger.verify().ok


def test_a_tight_hold_pays_provider_then_royalty_then_fee(money):
    ledger, billing = money
    job = _job(billing, "job-2", "ink", rate=None)  # cold market: the reserve, the whole hold
    billing.settle(job, "100")
    # charge 1,000,000: provider 900,000 first; royalty gets the 100,000 left; no fee
    assert _balances(ledger) == (10_000_000 - 1_000_000, 900_000, 100_000, 0)


def test_jobs_without_paid_adapters_post_no_royalty_leg(money):
    ledger, billing = money
    for job_id, adapters in (("job-3", ""), ("job-4", "film:1"), ("job-5", "someones-own")):
        job = _job(billing, job_id, adapters, rate=5_000)
        billing.settle(job, "100")
        assert ledger.get_hold(job.hold_id).publisher is None
    assert _balances(ledger) == (10_000_000 - 3 * 500_000, 3 * 450_000, 0, 3 * 50_000)


def test_a_cancelled_job_pays_no_royalty(money):
    ledger, billing = money
    job = _job(billing, "job-6", "ink", rate=6_000)
    # half the work shown (checkpoints, tokens): 300,000 charged (270,000 + 30,000 fee),
    # no royalty
    billing.cancelled(job, "client cancelled", Fraction(1, 2))
    assert _balances(ledger) == (10_000_000 - 300_000, 270_000, 0, 30_000)


def test_the_hold_at_submit_covers_the_royalty_so_the_fee_is_not_cut(money):
    ledger, billing = money
    inputs = {"prompt": "a lighthouse", "adapters": "ink"}
    hold_id, amount = billing.hold("job-9", CLIENT, "sd15", 100.0, inputs=inputs)
    assert amount == 1_000_000 + 250_000  # the reserve price plus the adapter's royalty
    job = Job(id="job-9", account_id=CLIENT, plugin="sd15", plugin_version="1.0.0",
              inputs=inputs, state=JobState.SETTLED, provider_id="machine-1", work_units=100.0,
              hold_id=hold_id, max_price_micro=amount, price_micro_per_unit=None,
              created_at=time.time())
    billing.settle(job, "100")
    # cold market: charge 1,000,000 = provider 900,000 + fee 100,000; royalty 250,000
    assert _balances(ledger) == (10_000_000 - 1_250_000, 900_000, 250_000, 100_000)


def test_a_job_resumed_on_another_provider_pays_the_royalty_once(money):
    from fractions import Fraction

    from broker.billing.shared import settle_shared
    from broker.jobs.checkpoints import Part

    ledger, billing = money
    job = _job(billing, "job-10", "ink:0.8", rate=6_000)
    # machine-0 did 40 % before the job moved; the finishing provider the other 60 %
    part = Part(provider_id="machine-0", attempt=0, fraction=Fraction(2, 5),
                rate_micro_per_unit=6_000)
    txn = settle_shared(billing, job, "100", [part], Fraction(2, 5))
    # shares 240,000 and 360,000 (each 90 % provider, 10 % fee); royalty 250,000 once
    assert _balances(ledger) == (10_000_000 - 850_000, 540_000, 250_000, 60_000)
    hold = ledger.get_hold(job.hold_id)
    assert (hold.publisher, hold.royalty_micro) == (PUBLISHER.account_id, 250_000)
    assert settle_shared(billing, job, "100", [part], Fraction(2, 5)).id == txn.id
    assert _balances(ledger)[2] == 250_000
    assert ledger.verify().ok


def test_a_resumed_check_pays_no_royalty(money):
    from fractions import Fraction

    from broker.billing.shared import settle_shared
    from broker.jobs.checkpoints import Part

    ledger, billing = money
    job = _job(billing, "job-11", "ink", rate=6_000)
    job.check_of = "job-10"
    part = Part(provider_id="machine-0", attempt=0, fraction=Fraction(1, 2),
                rate_micro_per_unit=6_000)
    settle_shared(billing, job, "100", [part], Fraction(1, 2))
    assert _balances(ledger)[2] == 0
    assert ledger.get_hold(job.hold_id).publisher is None


def test_each_publisher_whose_adapters_a_job_uses_is_paid(money, tmp_path):
    ledger, billing = money
    other = Principal("acct-pub-2", "publisher", "k2")
    registry = billing.royalty_of.__self__  # the RegistryService the fixture wired in
    keys = register(registry, other)
    publish(registry, other, keys, adapter_folder(tmp_path / "p2", name="neon", royalty=100_000))

    def royalties():
        return (ledger.balances(PUBLISHER.account_id).get(AccountKind.PUBLISHER_ROYALTIES, 0),
                ledger.balances(other.account_id).get(AccountKind.PUBLISHER_ROYALTIES, 0))

    job = _job(billing, "job-12", "neon:0.5,ink:0.8", rate=6_000)
    billing.settle(job, "100")
    # provider 540,000 and fee 60,000; both royalties fit in the 400,000 left
    assert royalties() == (250_000, 100_000)
    assert ledger.get_hold(job.hold_id).royalty_legs == [(other.account_id, 100_000),
                                                          (PUBLISHER.account_id, 250_000)]
    # a tight hold pays the publishers in the order the job names their adapters
    job = _job(billing, "job-13", "neon,ink", rate=None)  # charge 1,000,000: 100,000 left
    billing.settle(job, "100")
    assert royalties() == (250_000, 200_000)
    # a refund (a lost dispute) takes every royalty back
    ledger.refund(job.hold_id, idempotency_key="r")
    assert royalties() == (250_000, 100_000)
    assert ledger.verify().ok
