"""post_shared: a job that several providers worked on in turn is paid in one ledger step;
the client pays once, within its hold, and each share vests and refunds like any post."""
from __future__ import annotations

import pytest

from broker.ledger import AccountKind, Splits
from broker.ledger import errors as lerr

from .conftest import VESTING_WINDOW_S


@pytest.fixture
def ledger(sql_ledger):
    """On SQLite and PostgreSQL (the in-memory repository shares the service code)."""
    return sql_ledger


def _fund(ledger, amount=1_000_000):
    ledger.deposit("alice", amount, idempotency_key="fund")
    return ledger.hold("alice", 600_000, "job-1", idempotency_key="h")


def test_each_provider_gets_its_share_and_the_client_pays_their_sum(ledger, clock):
    hold = _fund(ledger)
    main = Splits(provider="dave", provider_micro=270_000, fee_micro=30_000)
    first = Splits(provider="bob", provider_micro=180_000, fee_micro=20_000)
    txn = ledger.post_shared(hold.id, main, [first], idempotency_key="p")
    assert ledger.balances("bob")[AccountKind.PROVIDER_VESTING] == 180_000
    assert ledger.balances("dave")[AccountKind.PROVIDER_VESTING] == 270_000
    alice = ledger.balances("alice")
    assert alice[AccountKind.CLIENT_AVAILABLE] == 1_000_000 - 500_000
    assert alice.get(AccountKind.CLIENT_HELD, 0) == 0
    assert ledger.verify().ok
    # idempotent: the same key and shares give the same transaction and move nothing
    assert ledger.post_shared(hold.id, main, [first], idempotency_key="p").id == txn.id
    assert ledger.balances("bob")[AccountKind.PROVIDER_VESTING] == 180_000
    with pytest.raises(lerr.IdempotencyConflict):
        ledger.post_shared(hold.id, main, [], idempotency_key="p")
    # both shares vest after the window
    clock.advance(VESTING_WINDOW_S + 1)
    ledger.vest("bob")
    ledger.vest("dave")
    assert ledger.balances("bob")[AccountKind.PROVIDER_AVAILABLE] == 180_000
    assert ledger.balances("dave")[AccountKind.PROVIDER_AVAILABLE] == 270_000
    assert ledger.verify().ok


def test_shares_beyond_the_hold_are_refused_and_nothing_moves(ledger):
    hold = _fund(ledger)
    with pytest.raises(lerr.InvalidAmount):
        ledger.post_shared(hold.id, Splits("dave", 400_000), [Splits("bob", 300_000)],
                           idempotency_key="p")
    assert ledger.get_hold(hold.id).state.value == "pending"
    assert ledger.balances("alice")[AccountKind.CLIENT_HELD] == 600_000
    assert ledger.verify().ok


def test_the_main_share_carries_the_jobs_royalty_and_a_refund_returns_it(ledger):
    hold = _fund(ledger)
    ledger.open_publisher("pat")
    main = Splits(provider="dave", provider_micro=270_000, fee_micro=30_000,
                  publisher="pat", royalty_micro=50_000)
    first = Splits(provider="bob", provider_micro=180_000, fee_micro=20_000)
    txn = ledger.post_shared(hold.id, main, [first], idempotency_key="p")
    assert ledger.balances("pat")[AccountKind.PUBLISHER_ROYALTIES] == 50_000
    assert ledger.balances("alice")[AccountKind.CLIENT_AVAILABLE] == 1_000_000 - 550_000
    posted = ledger.get_hold(hold.id)
    assert (posted.publisher, posted.royalty_micro, posted.captured_micro) == ("pat", 50_000,
                                                                              350_000)
    assert ledger.post_shared(hold.id, main, [first], idempotency_key="p").id == txn.id
    with pytest.raises(lerr.IdempotencyConflict):  # the same shares without the royalty
        ledger.post_shared(hold.id, Splits("dave", 270_000, 30_000), [first],
                           idempotency_key="p")
    ledger.refund(hold.id, idempotency_key="r")
    assert ledger.balances("pat")[AccountKind.PUBLISHER_ROYALTIES] == 0
    assert ledger.verify().ok


def test_a_royalty_on_an_earlier_share_is_refused_and_nothing_moves(ledger):
    hold = _fund(ledger)
    ledger.open_publisher("pat")
    with pytest.raises(lerr.InvalidArgument, match="royalty once"):
        ledger.post_shared(hold.id, Splits("dave", 270_000),
                           [Splits("bob", 180_000, publisher="pat", royalty_micro=1)],
                           idempotency_key="p")
    with pytest.raises(lerr.InvalidArgument, match="publisher is None"):
        ledger.post_shared(hold.id, Splits("dave", 270_000, royalty_micro=5), [],
                           idempotency_key="p")
    assert ledger.get_hold(hold.id).state.value == "pending"
    assert ledger.verify().ok
