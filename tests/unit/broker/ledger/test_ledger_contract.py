"""Behaviour of LedgerService, checked against every repository: in memory, and SQL on
SQLite and PostgreSQL (one contract class, one subclass per storage)."""
from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from decimal import Decimal

import pytest

from broker.ledger import AccountId, AccountKind, FundingSource, HoldState, Splits, TransactionKind
from broker.ledger.errors import (
    AlreadyRefunded, HoldAlreadyResolved, HoldExpired, HoldNotExpired, IdempotencyConflict,
    InsufficientCredits, InvalidAmount, InvalidArgument, NotRefundable, NotReversible,
    PostsNotBatched, UnknownAccount, UnknownHold, UnknownTransaction,
)
from broker.ledger.model import MAX_AMOUNT_MICRO

from .conftest import VESTING_WINDOW_S

C = 1_000_000  # one credit in micro-credits
ALICE = AccountId(AccountKind.CLIENT_AVAILABLE, "alice")
ALICE_HELD = AccountId(AccountKind.CLIENT_HELD, "alice")
BOB_VESTING = AccountId(AccountKind.PROVIDER_VESTING, "bob")
BOB_AVAILABLE = AccountId(AccountKind.PROVIDER_AVAILABLE, "bob")
BOB_STAKE = AccountId(AccountKind.PROVIDER_STAKE, "bob")
PUB = AccountId(AccountKind.PUBLISHER_ROYALTIES, "pub")
FEES = AccountId.platform(AccountKind.PLATFORM_FEES)
CLEARING = AccountId.platform(AccountKind.PLATFORM_PAYMENT_CLEARING)
GRANTS = AccountId.platform(AccountKind.PLATFORM_DEV_GRANTS)
SPLITS = Splits(provider="bob", provider_micro=6 * C, fee_micro=1 * C, publisher="pub",
                royalty_micro=C // 2)


def snapshot(ledger):
    """Everything a refused operation must leave unchanged."""
    audit = ledger.verify()
    assert audit.ok, audit.problems
    return (audit.transactions, {o: ledger.balances(o) for o in ("alice", "bob", "pub", "platform")})


class LedgerContract:
    """Subclasses provide a ``ledger`` fixture (LedgerService with parties opened) and use
    the ``clock`` fixture."""

    # ---- deposits and idempotency

    def test_deposit_credits_client_and_debits_clearing(self, ledger):
        txn = ledger.deposit("alice", 10 * C, idempotency_key="stripe:evt_1")
        assert txn.kind is TransactionKind.DEPOSIT
        assert sum(e.amount_micro for e in txn.entries) == 0
        assert ledger.balance(ALICE) == 10 * C
        assert ledger.balance(CLEARING) == -10 * C
        ledger.deposit("alice", 2 * C, idempotency_key="grant:1", source=FundingSource.DEV_GRANT)
        assert ledger.balance(GRANTS) == -2 * C
        assert ledger.balance(ALICE) == 12 * C

    def test_same_key_same_payload_returns_same_transaction_without_new_entries(self, ledger):
        first = ledger.deposit("alice", 10 * C, idempotency_key="k")
        before = snapshot(ledger)
        again = ledger.deposit("alice", 10 * C, idempotency_key="k")
        assert again.id == first.id and again.entries == first.entries
        assert snapshot(ledger) == before

    def test_same_key_other_payload_is_refused(self, ledger):
        ledger.deposit("alice", 10 * C, idempotency_key="k")
        before = snapshot(ledger)
        with pytest.raises(IdempotencyConflict) as err:
            ledger.deposit("alice", 11 * C, idempotency_key="k")
        assert err.value.http_status == 409 and "new key" in err.value.message
        with pytest.raises(IdempotencyConflict):  # another operation with the same key
            ledger.hold("alice", C, "job-1", idempotency_key="k")
        assert snapshot(ledger) == before

    def test_refused_operation_leaves_key_unused(self, ledger):
        with pytest.raises(InsufficientCredits):
            ledger.hold("alice", 5 * C, "job-1", idempotency_key="h")
        ledger.deposit("alice", 5 * C, idempotency_key="d")
        hold = ledger.hold("alice", 5 * C, "job-1", idempotency_key="h")
        assert hold.state is HoldState.PENDING

    # ---- holds

    def test_hold_moves_available_to_held_and_replays(self, ledger):
        ledger.deposit("alice", 10 * C, idempotency_key="d")
        hold = ledger.hold("alice", 4 * C, "job-1", idempotency_key="h")
        assert (ledger.balance(ALICE), ledger.balance(ALICE_HELD)) == (6 * C, 4 * C)
        assert ledger.hold("alice", 4 * C, "job-1", idempotency_key="h").id == hold.id
        assert ledger.balance(ALICE) == 6 * C

    def test_overdraft_is_refused_with_402_and_nothing_written(self, ledger):
        ledger.deposit("alice", 8 * C, idempotency_key="d")
        before = snapshot(ledger)
        with pytest.raises(InsufficientCredits) as err:
            ledger.hold("alice", 12 * C, "job-1", idempotency_key="h")
        e = err.value
        assert (e.http_status, e.needed_micro, e.available_micro) == (402, 12 * C, 8 * C)
        assert "needs 12 credits" in e.message and "balance" in e.message and "8 credits" in e.message
        assert "/v1/credits/checkout" in e.message
        assert snapshot(ledger) == before

    def test_full_post_pays_provider_publisher_platform(self, ledger):
        ledger.deposit("alice", 10 * C, idempotency_key="d")
        hold = ledger.hold("alice", 7_500_000, "job-1", idempotency_key="h")
        txn = ledger.post(hold.id, SPLITS, idempotency_key="p")
        assert txn.kind is TransactionKind.POST and sum(e.amount_micro for e in txn.entries) == 0
        assert ledger.balance(ALICE_HELD) == 0
        assert ledger.balance(ALICE) == 2_500_000
        assert (ledger.balance(BOB_VESTING), ledger.balance(PUB), ledger.balance(FEES)) == (6 * C, C // 2, C)
        posted = ledger.get_hold(hold.id)
        assert posted.state is HoldState.POSTED
        assert (posted.captured_micro, posted.released_micro) == (7_500_000, 0)

    def test_a_post_pays_each_publisher_its_royalty_and_a_refund_returns_them(self, ledger):
        ledger.open_publisher("pub2")
        pub2 = AccountId(AccountKind.PUBLISHER_ROYALTIES, "pub2")
        ledger.deposit("alice", 10 * C, idempotency_key="d")
        hold = ledger.hold("alice", 10 * C, "job-1", idempotency_key="h")
        two = replace(SPLITS, other_royalties=(("pub2", C // 4),))
        assert two.captured_micro == 7_750_000
        txn = ledger.post(hold.id, two, idempotency_key="p")
        assert sum(e.amount_micro for e in txn.entries) == 0
        assert (ledger.balance(PUB), ledger.balance(pub2)) == (C // 2, C // 4)
        assert ledger.balance(ALICE) == 10 * C - 7_750_000
        posted = ledger.get_hold(hold.id)  # read back from storage
        assert posted.royalty_legs == [("pub", C // 2), ("pub2", C // 4)]
        assert ledger.post(hold.id, two, idempotency_key="p").id == txn.id
        with pytest.raises(IdempotencyConflict):  # the same key without the second royalty
            ledger.post(hold.id, SPLITS, idempotency_key="p")
        ledger.refund(hold.id, idempotency_key="r")
        assert (ledger.balance(PUB), ledger.balance(pub2), ledger.balance(ALICE)) == (0, 0, 10 * C)
        assert ledger.verify().ok

    # ---- several posts at once (receipt batches, issue #28)

    def _holds(self, ledger, n, amount=2 * C):
        ledger.deposit("alice", 10 * C, idempotency_key="d")
        return [ledger.hold("alice", amount, f"job-{i}", idempotency_key=f"h{i}")
                for i in range(n)]

    def _posts(self, holds):
        """Full, partial and royalty posts, and one to another provider."""
        splits = [Splits("bob", C, fee_micro=C // 10),
                  Splits("bob", 2 * C - C // 4, fee_micro=C // 4),
                  Splits("dave", C // 2, fee_micro=0),
                  Splits("bob", C, fee_micro=C // 10, publisher="pub", royalty_micro=C // 5)]
        return [(h.id, splits[i % len(splits)], f"p{i}", 60 * i) for i, h in enumerate(holds)]

    def test_a_batch_of_posts_leaves_what_the_posts_one_by_one_leave(self, ledger):
        holds = self._holds(ledger, 5)
        posts = self._posts(holds)
        txns = ledger.post_many(posts)
        assert [t.hold_id for t in txns] == [h.id for h in holds]
        assert all(t.kind is TransactionKind.POST and sum(e.amount_micro for e in t.entries) == 0
                   for t in txns)
        # what five posts one after another leave: each hold's captured part paid, the
        # rest back to alice
        captured = [sp.captured_micro for _, sp, _, _ in posts]
        assert ledger.balance(ALICE) == 10 * C - sum(captured)
        assert ledger.balance(ALICE_HELD) == 0
        assert ledger.balance(BOB_VESTING) == C + (2 * C - C // 4) + C + C
        assert ledger.balance(AccountId(AccountKind.PROVIDER_VESTING, "dave")) == C // 2
        assert ledger.balance(PUB) == C // 5
        assert ledger.balance(FEES) == C // 10 + C // 4 + C // 10 + C // 10
        for (hold_id, sp, key, window), txn in zip(posts, txns):
            hold = ledger.get_hold(hold_id)
            assert hold.state is HoldState.POSTED and hold.resolve_transaction_id == txn.id
            assert (hold.captured_micro, hold.released_micro) == (sp.captured_micro,
                                                                  2 * C - sp.captured_micro)
            assert hold.vests_at == hold.resolved_at + timedelta(seconds=window)
            assert ledger.get_transaction(txn.id).entries == txn.entries  # as stored
            # a replay of any of them, alone, finds the batch's transaction
            assert ledger.post(hold_id, sp, idempotency_key=key, vesting_window_s=window).id == txn.id
        assert ledger.verify().ok and ledger.verify().transactions == 1 + 5 + 5

    def test_a_replayed_batch_writes_nothing_and_says_so(self, ledger):
        holds = self._holds(ledger, 3)
        posts = self._posts(holds)
        ledger.post(*posts[1][:2], idempotency_key=posts[1][2], vesting_window_s=posts[1][3])
        before = snapshot(ledger)
        with pytest.raises(PostsNotBatched):  # one key of the batch is taken
            ledger.post_many(posts)
        assert snapshot(ledger) == before
        assert ledger.get_hold(holds[0].id).state is HoldState.PENDING
        ledger.post_many([posts[0], posts[2]])
        with pytest.raises(PostsNotBatched):  # every key taken: a replay of the batch
            ledger.post_many([posts[0], posts[2]])
        assert ledger.verify().ok and ledger.verify().transactions == 1 + 3 + 3

    def test_a_batch_with_a_hold_that_cannot_be_posted_writes_nothing(self, ledger, clock):
        holds = self._holds(ledger, 3)
        ledger.void(holds[2].id, idempotency_key="v", reason="cancelled")
        posts = self._posts(holds)
        before = snapshot(ledger)
        with pytest.raises(PostsNotBatched):  # resolved already
            ledger.post_many(posts)
        assert snapshot(ledger) == before
        with pytest.raises(PostsNotBatched):  # more than held
            ledger.post_many([posts[0], (holds[1].id, Splits("bob", 3 * C), "p1", None)])
        with pytest.raises(UnknownAccount):  # a provider without accounts
            ledger.post_many([posts[0], (holds[1].id, Splits("zed", C), "p1", None)])
        assert snapshot(ledger) == before
        # every key is free again: the same posts alone succeed
        assert ledger.post(*posts[0][:2], idempotency_key="p0", vesting_window_s=0).kind \
            is TransactionKind.POST
        clock.advance(3 * 24 * 3600)  # past the holds' TTL
        with pytest.raises(PostsNotBatched):
            ledger.post_many([posts[1]])
        assert ledger.verify().ok

    def test_a_batch_naming_a_hold_or_key_twice_or_a_bad_post_is_refused(self, ledger):
        holds = self._holds(ledger, 2)
        posts = self._posts(holds)
        before = snapshot(ledger)
        with pytest.raises(InvalidArgument):
            ledger.post_many([posts[0], (holds[1].id, posts[1][1], "p0", None)])
        with pytest.raises(InvalidArgument):
            ledger.post_many([posts[0], (holds[0].id, posts[1][1], "p1", None)])
        with pytest.raises(InvalidAmount):
            ledger.post_many([posts[0], (holds[1].id, Splits("bob", 0), "p1", None)])
        assert ledger.post_many([]) == []
        assert snapshot(ledger) == before

    def test_partial_post_releases_the_rest(self, ledger):
        ledger.deposit("alice", 10 * C, idempotency_key="d")
        hold = ledger.hold("alice", 10 * C, "job-1", idempotency_key="h")
        ledger.post(hold.id, Splits("bob", 3 * C, fee_micro=C), idempotency_key="p")
        assert ledger.balance(ALICE) == 6 * C and ledger.balance(ALICE_HELD) == 0
        assert ledger.get_hold(hold.id).released_micro == 6 * C

    def test_post_more_than_held_is_refused(self, ledger):
        ledger.deposit("alice", 10 * C, idempotency_key="d")
        hold = ledger.hold("alice", 2 * C, "job-1", idempotency_key="h")
        before = snapshot(ledger)
        with pytest.raises(InvalidAmount):
            ledger.post(hold.id, Splits("bob", 2 * C, fee_micro=1), idempotency_key="p")
        assert snapshot(ledger) == before
        assert ledger.get_hold(hold.id).state is HoldState.PENDING

    def test_hold_resolves_once(self, ledger):
        ledger.deposit("alice", 10 * C, idempotency_key="d")
        hold = ledger.hold("alice", 8 * C, "job-1", idempotency_key="h")
        posted = ledger.post(hold.id, SPLITS, idempotency_key="p")
        assert ledger.post(hold.id, SPLITS, idempotency_key="p").id == posted.id  # replay
        before = snapshot(ledger)
        with pytest.raises(HoldAlreadyResolved) as err:
            ledger.post(hold.id, SPLITS, idempotency_key="p2")
        assert err.value.http_status == 409
        with pytest.raises(HoldAlreadyResolved):
            ledger.void(hold.id, idempotency_key="v")
        assert snapshot(ledger) == before

    def test_void_releases_everything(self, ledger):
        ledger.deposit("alice", 10 * C, idempotency_key="d")
        hold = ledger.hold("alice", 5 * C, "job-1", idempotency_key="h")
        ledger.void(hold.id, idempotency_key="v", reason="cancelled")
        assert ledger.balance(ALICE) == 10 * C and ledger.balance(ALICE_HELD) == 0
        assert ledger.get_hold(hold.id).state is HoldState.VOIDED
        with pytest.raises(HoldAlreadyResolved):
            ledger.post(hold.id, SPLITS, idempotency_key="p")

    def test_expiry_follows_the_clock(self, ledger, clock):
        ledger.deposit("alice", 10 * C, idempotency_key="d")
        hold = ledger.hold("alice", 5 * C, "job-1", idempotency_key="h", ttl_s=60)
        with pytest.raises(HoldNotExpired):
            ledger.expire(hold.id)
        clock.advance(60)
        with pytest.raises(HoldExpired):
            ledger.post(hold.id, SPLITS, idempotency_key="p")
        swept = ledger.expire_due()
        assert [t.hold_id for t in swept] == [hold.id]
        assert ledger.expire(hold.id).id == swept[0].id  # idempotent
        assert ledger.get_hold(hold.id).state is HoldState.EXPIRED
        assert ledger.balance(ALICE) == 10 * C
        assert ledger.expire_due() == []

    def test_refund_before_vesting_then_not_again(self, ledger, clock):
        ledger.deposit("alice", 10 * C, idempotency_key="d")
        hold = ledger.hold("alice", 10 * C, "job-1", idempotency_key="h")
        ledger.post(hold.id, SPLITS, idempotency_key="p")
        refund = ledger.refund(hold.id, idempotency_key="r", reason="dispute lost")
        assert ledger.refund(hold.id, idempotency_key="r", reason="dispute lost").id == refund.id
        assert ledger.balance(ALICE) == 10 * C
        assert (ledger.balance(BOB_VESTING), ledger.balance(PUB), ledger.balance(FEES)) == (0, 0, 0)
        with pytest.raises(AlreadyRefunded) as again:  # a NotRefundable, naming the refund
            ledger.refund(hold.id, idempotency_key="r2", reason="again")
        assert isinstance(again.value, NotRefundable)
        assert again.value.transaction_id == refund.id
        clock.advance(VESTING_WINDOW_S)
        assert ledger.vest("bob") is None  # refunded shares never vest

    def test_vesting_waits_for_the_window_and_blocks_refund(self, ledger, clock):
        ledger.deposit("alice", 20 * C, idempotency_key="d")
        for n in (1, 2):
            hold = ledger.hold("alice", 10 * C, f"job-{n}", idempotency_key=f"h{n}")
            ledger.post(hold.id, SPLITS, idempotency_key=f"p{n}")
        assert ledger.vest("bob") is None
        clock.advance(VESTING_WINDOW_S - 1)
        assert ledger.vest("bob") is None
        clock.advance(1)
        txn = ledger.vest("bob")
        assert txn.kind is TransactionKind.VEST and txn.amount_for(BOB_AVAILABLE) == 12 * C
        assert (ledger.balance(BOB_VESTING), ledger.balance(BOB_AVAILABLE)) == (0, 12 * C)
        assert ledger.vest("bob") is None
        with pytest.raises(NotRefundable) as vested:
            ledger.refund(hold.id, idempotency_key="r", reason="late finding")
        assert not isinstance(vested.value, AlreadyRefunded)

    def test_payout_and_reversal_when_transfer_fails(self, ledger, clock):
        ledger.deposit("alice", 10 * C, idempotency_key="d")
        hold = ledger.hold("alice", 10 * C, "job-1", idempotency_key="h")
        ledger.post(hold.id, SPLITS, idempotency_key="p")
        clock.advance(VESTING_WINDOW_S)
        ledger.vest("bob")
        with pytest.raises(InsufficientCredits):
            ledger.payout(BOB_AVAILABLE, 7 * C, idempotency_key="po0")
        payout = ledger.payout(BOB_AVAILABLE, 5 * C, idempotency_key="po")
        assert ledger.balance(BOB_AVAILABLE) == C
        reversal = ledger.reverse(payout.id, idempotency_key="po-failed", reason="transfer failed")
        assert reversal.reverses_id == payout.id
        assert {e.account: e.amount_micro for e in reversal.entries} == {
            e.account: -e.amount_micro for e in payout.entries}
        assert ledger.balance(BOB_AVAILABLE) == 6 * C
        with pytest.raises(NotReversible):
            ledger.reverse(payout.id, idempotency_key="again", reason="twice")
        with pytest.raises(NotReversible):
            ledger.reverse(reversal.id, idempotency_key="rr", reason="undo")
        ledger.payout(PUB, C // 2, idempotency_key="po-pub")
        assert ledger.balance(PUB) == 0

    def test_hold_transactions_are_not_reversible(self, ledger):
        ledger.deposit("alice", 10 * C, idempotency_key="d")
        hold = ledger.hold("alice", 10 * C, "job-1", idempotency_key="h")
        with pytest.raises(NotReversible):
            ledger.reverse(hold.hold_transaction_id, idempotency_key="r", reason="x")

    def test_deposit_reversal_cannot_overdraw(self, ledger):
        deposit = ledger.deposit("alice", 10 * C, idempotency_key="d")
        ledger.hold("alice", 6 * C, "job-1", idempotency_key="h")
        before = snapshot(ledger)
        with pytest.raises(InsufficientCredits):
            ledger.reverse(deposit.id, idempotency_key="chargeback", reason="chargeback")
        assert snapshot(ledger) == before

    def test_stake_unstake_slash(self, ledger, clock):
        ledger.deposit("alice", 10 * C, idempotency_key="d")
        hold = ledger.hold("alice", 10 * C, "job-1", idempotency_key="h")
        ledger.post(hold.id, Splits("bob", 10 * C), idempotency_key="p")
        clock.advance(VESTING_WINDOW_S)
        ledger.vest("bob")
        ledger.stake("bob", 4 * C, idempotency_key="s")
        ledger.unstake("bob", C, idempotency_key="u")
        ledger.slash("bob", 2 * C, idempotency_key="x", reason="failed check")
        assert ledger.balances("bob")[AccountKind.PROVIDER_STAKE] == C
        assert ledger.balance(BOB_AVAILABLE) == 7 * C and ledger.balance(FEES) == 2 * C
        with pytest.raises(InsufficientCredits):
            ledger.slash("bob", 2 * C, idempotency_key="x2")

    # ---- reads

    def test_history_newest_first_and_balances(self, ledger):
        ledger.deposit("alice", 10 * C, idempotency_key="d", memo="checkout")
        hold = ledger.hold("alice", 3 * C, "job-1", idempotency_key="h")
        lines = ledger.history(ALICE)
        assert [(l.kind, l.amount_micro) for l in lines] == [
            (TransactionKind.HOLD, -3 * C), (TransactionKind.DEPOSIT, 10 * C)]
        assert lines[0].hold_id == hold.id and lines[1].memo == "checkout"
        assert lines[0].created_at.utcoffset().total_seconds() == 0
        assert ledger.history(ALICE, limit=1) == lines[:1]
        assert ledger.balances("alice") == {AccountKind.CLIENT_AVAILABLE: 7 * C,
                                            AccountKind.CLIENT_HELD: 3 * C}

    def test_opening_accounts_is_idempotent(self, ledger):
        ledger.deposit("alice", 10 * C, idempotency_key="d")
        ledger.open_client("alice")
        assert ledger.balance(ALICE) == 10 * C

    # ---- bad input: refused, nothing written

    @pytest.mark.parametrize("amount", [0, -1, -5 * C, 1.0, 2.5, True, False, "5", None,
                                        Decimal("1"), MAX_AMOUNT_MICRO + 1])
    def test_bad_amounts_are_refused(self, ledger, amount):
        ledger.deposit("alice", 10 * C, idempotency_key="d")
        before = snapshot(ledger)
        calls = [
            lambda: ledger.deposit("alice", amount, idempotency_key="bad1"),
            lambda: ledger.hold("alice", amount, "job", idempotency_key="bad2"),
            lambda: ledger.payout(BOB_AVAILABLE, amount, idempotency_key="bad3"),
            lambda: ledger.stake("bob", amount, idempotency_key="bad4"),
        ]
        for call in calls:
            with pytest.raises(InvalidAmount) as err:
                call()
            assert err.value.http_status == 422 and repr(amount) in err.value.message
        assert snapshot(ledger) == before

    @pytest.mark.parametrize("splits", [
        Splits("bob", -1), Splits("bob", 0), Splits("bob", 1.5), Splits("bob", True),
        Splits("bob", C, fee_micro=-1), Splits("bob", C, royalty_micro=5),  # royalty, no publisher
        Splits("", C), Splits("bob", C, publisher="nobody", royalty_micro=1),
        Splits("nobody", C),
        Splits("bob", C, other_royalties=(("pub", 1),)),  # others without the first
        Splits("bob", C, publisher="pub", royalty_micro=1, other_royalties=(("pub", 1),)),
        Splits("bob", C, publisher="pub", royalty_micro=1, other_royalties=(("nobody", 1),)),
        Splits("bob", C, publisher="pub", royalty_micro=1, other_royalties=(("x", 0),)),
        Splits("bob", C, publisher="pub", royalty_micro=1, other_royalties=("x", 1)),
        Splits("bob", C, publisher="pub", royalty_micro=1, other_royalties=[("x", 1)]),
    ])
    def test_bad_splits_are_refused(self, ledger, splits):
        ledger.deposit("alice", 10 * C, idempotency_key="d")
        hold = ledger.hold("alice", 5 * C, "job-1", idempotency_key="h")
        before = snapshot(ledger)
        with pytest.raises((InvalidAmount, InvalidArgument, UnknownAccount)):
            ledger.post(hold.id, splits, idempotency_key="p")
        assert snapshot(ledger) == before
        assert ledger.get_hold(hold.id).state is HoldState.PENDING

    def test_unknown_things_are_refused(self, ledger):
        before = snapshot(ledger)
        with pytest.raises(UnknownAccount) as err:
            ledger.deposit("zed", C, idempotency_key="d")
        assert err.value.http_status == 404 and "open_client" in err.value.message
        with pytest.raises(UnknownAccount):
            ledger.balance(AccountId(AccountKind.CLIENT_AVAILABLE, "zed"))
        with pytest.raises(UnknownHold):
            ledger.post("nohold", SPLITS, idempotency_key="p")
        with pytest.raises(UnknownHold):
            ledger.void("nohold", idempotency_key="v")
        with pytest.raises(UnknownTransaction):
            ledger.reverse("notxn", idempotency_key="r", reason="x")
        with pytest.raises(InvalidArgument):
            ledger.deposit("alice", C, idempotency_key="")
        with pytest.raises(InvalidArgument):
            ledger.deposit("alice", C, idempotency_key="k" * 201)
        with pytest.raises(InvalidArgument):
            ledger.payout(ALICE, C, idempotency_key="k")
        with pytest.raises(InvalidArgument):
            ledger.hold("alice", C, "job", idempotency_key="k", ttl_s=0)
        assert snapshot(ledger) == before


class TestInMemoryLedger(LedgerContract):
    @pytest.fixture
    def ledger(self, memory_service):
        return memory_service


class TestSqlLedger(LedgerContract):
    @pytest.fixture
    def ledger(self, sql_ledger):
        return sql_ledger
