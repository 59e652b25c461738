"""A Hypothesis state machine drives the ledger through random sequences of deposits,
holds, full and partial posts, voids, expiries, refunds, vesting, payouts, failed payouts,
chargebacks and replayed idempotency keys, against a simple model of the balances.

After every step: all entries sum to zero (overall and per transaction), cached balances
equal their entries, no balance is below zero where its kind forbids it, every balance
equals the model's, and each refused operation changed nothing. Runs on the in-memory
repository and on SQL (SQLite and PostgreSQL)."""
from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test,
)

from broker.ledger import AccountId, AccountKind, FundingSource, HoldState, LedgerService, Splits
from broker.ledger.errors import (
    HoldAlreadyResolved, HoldExpired, IdempotencyConflict, InsufficientCredits, InvalidAmount,
)
from broker.ledger.memory import FakeClock, InMemoryLedgerRepository

from .conftest import VESTING_WINDOW_S, open_parties

C = 1_000_000
CLIENTS = ("alice", "carol")
PROVIDERS = ("bob", "dave")
PUBLISHER = "pub"
OWNERS = (*CLIENTS, *PROVIDERS, PUBLISHER, "platform")
# Round figures make holds fit deposits often enough to reach posts, refunds and vesting.
amounts = st.one_of(st.sampled_from([C // 2, C, 2 * C, 5 * C]), st.integers(min_value=1, max_value=20 * C))


def A(kind: AccountKind, owner: str) -> AccountId:
    return AccountId(kind, owner)


def make_machine(new_service):
    """A state machine class whose each run starts from ``new_service(clock)``."""

    class LedgerMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.clock = FakeClock()
            self.ledger: LedgerService = open_parties(new_service(self.clock))
            self.model: dict[AccountId, int] = {}
            for owner, kinds in self.ledger_layout():
                for kind in kinds:
                    self.model[A(kind, owner)] = 0
            self.holds: dict[str, dict] = {}
            self.reversible: dict[str, bool] = {}  # deposit/payout id -> reversed?
            self.replays: list[tuple] = []  # (callable-maker, result id)
            self.n = 0

        @staticmethod
        def ledger_layout():
            yield from ((c, (AccountKind.CLIENT_AVAILABLE, AccountKind.CLIENT_HELD)) for c in CLIENTS)
            yield from ((p, (AccountKind.PROVIDER_VESTING, AccountKind.PROVIDER_AVAILABLE,
                             AccountKind.PROVIDER_STAKE)) for p in PROVIDERS)
            yield PUBLISHER, (AccountKind.PUBLISHER_ROYALTIES,)
            yield "platform", (AccountKind.PLATFORM_FEES, AccountKind.PLATFORM_PAYMENT_CLEARING,
                               AccountKind.PLATFORM_DEV_GRANTS, AccountKind.PLATFORM_VERIFICATION)

        def key(self) -> str:
            self.n += 1
            return f"k{self.n}"

        def model_allows(self, legs) -> bool:
            net: dict[AccountId, int] = {}
            for account, amount in legs:
                net[account] = net.get(account, 0) + amount
            return all(amount >= 0 or account.kind.allows_negative
                       or self.model[account] + amount >= 0 for account, amount in net.items())

        def apply(self, legs) -> None:
            for account, amount in legs:
                self.model[account] += amount

        def attempt(self, legs, call):
            """Run ``call`` if the model says the legs fit, else expect InsufficientCredits."""
            if self.model_allows(legs):
                result = call()
                self.apply(legs)
                return result
            with pytest.raises(InsufficientCredits):
                call()
            return None

        def pick(self, data, predicate):
            # Creation order, not id order: ids are random, draws must not depend on them.
            ids = [h for h, v in self.holds.items() if predicate(v)]
            return data.draw(st.sampled_from(ids)) if ids else None

        # ---------------------------------------------------------------- rules

        @initialize()
        def fund_clients(self):
            for client in CLIENTS:
                self.deposit(client, 20 * C, FundingSource.PAYMENT)

        @rule(client=st.sampled_from(CLIENTS), amount=amounts, source=st.sampled_from(FundingSource))
        def deposit(self, client, amount, source):
            key = self.key()
            txn = self.ledger.deposit(client, amount, idempotency_key=key, source=source)
            self.apply([(source.account, -amount), (A(AccountKind.CLIENT_AVAILABLE, client), amount)])
            self.reversible[txn.id] = False
            self.replays.append((lambda: self.ledger.deposit(client, amount, idempotency_key=key,
                                                             source=source),
                                 lambda: self.ledger.deposit(client, amount + 1, idempotency_key=key,
                                                             source=source), txn.id))

        @rule(client=st.sampled_from(CLIENTS), amount=amounts, ttl_s=st.sampled_from([60, 3600]))
        def hold(self, client, amount, ttl_s):
            key = self.key()
            job = f"job-{self.n}"
            hold = self.attempt(
                [(A(AccountKind.CLIENT_AVAILABLE, client), -amount), (A(AccountKind.CLIENT_HELD, client), amount)],
                lambda: self.ledger.hold(client, amount, job, idempotency_key=key, ttl_s=ttl_s))
            if hold is not None:
                assert hold.expires_at == self.clock.now() + timedelta(seconds=ttl_s)
                self.holds[hold.id] = {"state": HoldState.PENDING, "client": client, "amount": amount,
                                       "expires_at": hold.expires_at, "vested": False, "refunded": False}
                self.replays.append((lambda: self.ledger.hold(client, amount, job, idempotency_key=key, ttl_s=ttl_s),
                                     lambda: self.ledger.hold(client, amount, job + "x", idempotency_key=key, ttl_s=ttl_s),
                                     hold.id))

        @rule(data=st.data(), provider=st.sampled_from(PROVIDERS), with_publisher=st.booleans())
        def post(self, data, provider, with_publisher):
            hold_id = self.pick(data, lambda h: h["state"] is HoldState.PENDING)
            if hold_id is None:
                return
            h = self.holds[hold_id]
            full = data.draw(st.booleans(), label="full")
            total = h["amount"] if full else data.draw(st.integers(0, h["amount"]), label="captured")
            provider_micro = data.draw(st.integers(0, total), label="provider_micro")
            fee = data.draw(st.integers(0, total - provider_micro), label="fee")
            royalty = total - provider_micro - fee if with_publisher else 0
            fee = fee if with_publisher else total - provider_micro
            splits = Splits(provider, provider_micro, fee_micro=fee,
                            publisher=PUBLISHER if with_publisher else None, royalty_micro=royalty)
            key = self.key()
            call = lambda: self.ledger.post(hold_id, splits, idempotency_key=key)  # noqa: E731
            if splits.captured_micro == 0:
                with pytest.raises(InvalidAmount):
                    call()
                return
            if self.clock.now() >= h["expires_at"]:
                with pytest.raises(HoldExpired):
                    call()
                return
            client = h["client"]
            txn = self.attempt([
                (A(AccountKind.CLIENT_HELD, client), -h["amount"]),
                (A(AccountKind.PROVIDER_VESTING, provider), provider_micro),
                (A(AccountKind.PUBLISHER_ROYALTIES, PUBLISHER), royalty),
                (AccountId.platform(AccountKind.PLATFORM_FEES), fee),
                (A(AccountKind.CLIENT_AVAILABLE, client), h["amount"] - splits.captured_micro)], call)
            h.update(state=HoldState.POSTED, splits=splits,
                     vests_at=self.clock.now() + timedelta(seconds=VESTING_WINDOW_S))
            self.replays.append((call, lambda: self.ledger.post(
                hold_id, Splits(provider, provider_micro + 1), idempotency_key=key), txn.id))

        @rule(data=st.data(), client=st.sampled_from(CLIENTS), amount=amounts,
              provider=st.sampled_from(PROVIDERS), with_publisher=st.booleans())
        def job_cycle(self, data, client, amount, provider, with_publisher):
            """A job's usual life: hold its price, then settle (weights posts, refunds and
            vesting up: with rules picked uniformly they would be rare)."""
            self.hold(client, amount, 3600)
            self.post(data, provider, with_publisher)

        @rule(data=st.data())
        def void(self, data):
            hold_id = self.pick(data, lambda h: h["state"] is HoldState.PENDING)
            if hold_id is None:
                return
            h = self.holds[hold_id]
            self.ledger.void(hold_id, idempotency_key=self.key())
            self.apply([(A(AccountKind.CLIENT_HELD, h["client"]), -h["amount"]),
                        (A(AccountKind.CLIENT_AVAILABLE, h["client"]), h["amount"])])
            h["state"] = HoldState.VOIDED

        @rule(data=st.data())
        def resolve_twice(self, data):
            hold_id = self.pick(data, lambda h: h["state"].resolved)
            if hold_id is None:
                return
            with pytest.raises(HoldAlreadyResolved):
                if data.draw(st.booleans()):
                    self.ledger.void(hold_id, idempotency_key=self.key())
                else:
                    self.ledger.post(hold_id, Splits("bob", 1), idempotency_key=self.key())

        @rule(seconds=st.sampled_from([30, 600, VESTING_WINDOW_S]))
        def advance(self, seconds):
            self.clock.advance(seconds)

        @rule()
        def expire_due(self):
            now = self.clock.now()
            due = {hid for hid, h in self.holds.items()
                   if h["state"] is HoldState.PENDING and h["expires_at"] <= now}
            expired = self.ledger.expire_due(limit=1000)
            assert {t.hold_id for t in expired} == due
            for hold_id in due:
                h = self.holds[hold_id]
                self.apply([(A(AccountKind.CLIENT_HELD, h["client"]), -h["amount"]),
                            (A(AccountKind.CLIENT_AVAILABLE, h["client"]), h["amount"])])
                h["state"] = HoldState.EXPIRED

        @rule(data=st.data())
        def refund(self, data):
            hold_id = self.pick(data, lambda h: h["state"] is HoldState.POSTED
                                and not h["vested"] and not h["refunded"])
            if hold_id is None:
                return
            h = self.holds[hold_id]
            s: Splits = h["splits"]
            self.attempt([
                (A(AccountKind.CLIENT_AVAILABLE, h["client"]), s.captured_micro),
                (A(AccountKind.PROVIDER_VESTING, s.provider), -s.provider_micro),
                (A(AccountKind.PUBLISHER_ROYALTIES, PUBLISHER), -s.royalty_micro),
                (AccountId.platform(AccountKind.PLATFORM_FEES), -s.fee_micro)],
                lambda: self.ledger.refund(hold_id, idempotency_key=self.key()))
            h["refunded"] = self.ledger.get_hold(hold_id).refund_transaction_id is not None

        @rule(provider=st.sampled_from(PROVIDERS))
        def vest(self, provider):
            now = self.clock.now()
            due = [h for h in self.holds.values() if h["state"] is HoldState.POSTED
                   and h["splits"].provider == provider and h["splits"].provider_micro > 0
                   and h["vests_at"] <= now and not h["vested"] and not h["refunded"]]
            total = sum(h["splits"].provider_micro for h in due)
            txn = self.ledger.vest(provider)
            assert (txn.amount_for(A(AccountKind.PROVIDER_AVAILABLE, provider)) if txn else 0) == total
            self.apply([(A(AccountKind.PROVIDER_VESTING, provider), -total),
                        (A(AccountKind.PROVIDER_AVAILABLE, provider), total)])
            for h in due:
                h["vested"] = True

        @rule(owner=st.sampled_from((*PROVIDERS, PUBLISHER)), amount=amounts)
        def payout(self, owner, amount):
            account = (A(AccountKind.PUBLISHER_ROYALTIES, owner) if owner == PUBLISHER
                       else A(AccountKind.PROVIDER_AVAILABLE, owner))
            txn = self.attempt([(account, -amount),
                                (AccountId.platform(AccountKind.PLATFORM_PAYMENT_CLEARING), amount)],
                               lambda: self.ledger.payout(account, amount, idempotency_key=self.key()))
            if txn is not None:
                self.reversible[txn.id] = False

        @rule(data=st.data())
        def reverse(self, data):
            """A failed payout transfer or a chargeback."""
            ids = [t for t, done in self.reversible.items() if not done]
            if not ids:
                return
            original = self.ledger.get_transaction(data.draw(st.sampled_from(ids)))
            result = self.attempt([(e.account, -e.amount_micro) for e in original.entries],
                                  lambda: self.ledger.reverse(original.id, idempotency_key=self.key(),
                                                              reason="test"))
            self.reversible[original.id] = result is not None

        @rule(data=st.data())
        def replay_key(self, data):
            if not self.replays:
                return
            same, other, result_id = data.draw(st.sampled_from(self.replays))
            before = self.ledger.verify().transactions
            assert same().id == result_id
            with pytest.raises(IdempotencyConflict):
                other()
            assert self.ledger.verify().transactions == before

        @rule(client=st.sampled_from(CLIENTS),
              amount=st.sampled_from([0, -1, 1.5, True, "3", -C]))
        def bad_amount(self, client, amount):
            with pytest.raises(InvalidAmount):
                self.ledger.hold(client, amount, "job", idempotency_key=self.key())

        # ---------------------------------------------------------------- invariants

        @invariant()
        def ledger_is_sound_and_matches_model(self):
            audit = self.ledger.verify()
            assert audit.ok, audit.problems
            actual = {}
            for owner in OWNERS:
                for kind, balance in self.ledger.balances(owner).items():
                    actual[A(kind, owner)] = balance
            assert actual == self.model
            assert all(v >= 0 for k, v in actual.items() if not k.kind.allows_negative)

        def teardown(self):
            for hold_id, h in self.holds.items():  # each hold in exactly the state we expect
                assert self.ledger.get_hold(hold_id).state is h["state"]

    return LedgerMachine


def _settings(max_examples: int) -> settings:
    return settings(max_examples=max_examples, stateful_step_count=40, deadline=None,
                    database=None, suppress_health_check=list(HealthCheck))


def test_ledger_state_machine_in_memory():
    machine = make_machine(lambda clock: LedgerService(
        InMemoryLedgerRepository(), clock=clock, vesting_window_s=VESTING_WINDOW_S))
    run_state_machine_as_test(machine, settings=_settings(50))


def test_ledger_state_machine_sql(db_url):
    from sqlalchemy import text

    from broker.storage.base import make_engine
    from broker.storage.ledger_sql import LEDGER_TABLES, SqlLedgerRepository, create_ledger_tables

    engine = make_engine(db_url)
    create_ledger_tables(engine)
    names = [t.name for t in reversed(LEDGER_TABLES)]

    def fresh(clock):
        with engine.begin() as conn:  # every run starts on empty tables
            if engine.dialect.name == "postgresql":
                conn.execute(text(f"TRUNCATE {', '.join(names)}"))
            else:
                conn.execute(text("UPDATE ledger_transactions SET reverses_id = NULL"))
                for name in names:
                    conn.execute(text(f"DELETE FROM {name}"))
        return LedgerService(SqlLedgerRepository(engine), clock=clock,
                             vesting_window_s=VESTING_WINDOW_S)

    try:
        run_state_machine_as_test(make_machine(fresh), settings=_settings(30))
    finally:
        engine.dispose()
