"""Values of the ledger: accounts, entries, transactions, holds and idempotency records.

All amounts are ``int`` micro-credits (1 credit = 1,000,000 micro-credits); names carry the
unit (``amount_micro``). Values are frozen dataclasses: a change is a new value, and the
ledger itself never updates or deletes an entry (corrections are reversing transactions).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

MICRO_PER_CREDIT = 1_000_000
#: Largest amount one operation may move: far above any real balance, and small enough that
#: sums of many amounts still fit PostgreSQL's BIGINT (2**63 - 1).
MAX_AMOUNT_MICRO = 10**9 * MICRO_PER_CREDIT  # one billion credits


def format_credits(amount_micro: int) -> str:
    """``1_200_000`` → ``'1.2 credits'``: exact, for messages (never for arithmetic)."""
    text = format(Decimal(amount_micro) / MICRO_PER_CREDIT, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return f"{text} credit" if text == "1" else f"{text} credits"


class AccountKind(str, enum.Enum):
    """What an account holds. The owner of platform accounts is always ``"platform"``."""

    CLIENT_AVAILABLE = "client_available"      # spendable credits of a client
    CLIENT_HELD = "client_held"                # reserved by pending holds
    PROVIDER_VESTING = "provider_vesting"      # earned, still claw-back-able (DESIGN §6)
    PROVIDER_AVAILABLE = "provider_available"  # vested, can be paid out or staked
    PROVIDER_STAKE = "provider_stake"          # at risk when verification finds cheating
    PUBLISHER_ROYALTIES = "publisher_royalties"
    PLATFORM_FEES = "platform_fees"
    # The outside world's counterpart: money in (Stripe Checkout) and out (Connect transfers).
    PLATFORM_PAYMENT_CLEARING = "platform_payment_clearing"
    # Counterpart of credits an admin grants with the `dev` funding backend (no Stripe keys).
    PLATFORM_DEV_GRANTS = "platform_dev_grants"
    # The platform's spending on verification: it funds the check runs it samples (DESIGN
    # §6) and goes below zero by what redundancy has cost.
    PLATFORM_VERIFICATION = "platform_verification"

    @property
    def allows_negative(self) -> bool:
        """Only the outside world's counterparts may go below zero."""
        return self in _NEGATIVE_ALLOWED

    @property
    def is_platform(self) -> bool:
        return self.value.startswith("platform_")


_NEGATIVE_ALLOWED = frozenset({AccountKind.PLATFORM_PAYMENT_CLEARING, AccountKind.PLATFORM_DEV_GRANTS,
                               AccountKind.PLATFORM_VERIFICATION})

CLIENT_KINDS = (AccountKind.CLIENT_AVAILABLE, AccountKind.CLIENT_HELD)
PROVIDER_KINDS = (AccountKind.PROVIDER_VESTING, AccountKind.PROVIDER_AVAILABLE, AccountKind.PROVIDER_STAKE)
PUBLISHER_KINDS = (AccountKind.PUBLISHER_ROYALTIES,)
PLATFORM_KINDS = (AccountKind.PLATFORM_FEES, AccountKind.PLATFORM_PAYMENT_CLEARING,
                  AccountKind.PLATFORM_DEV_GRANTS, AccountKind.PLATFORM_VERIFICATION)
PLATFORM_OWNER = "platform"


@dataclass(frozen=True, order=True)
class AccountId:
    """An account: its kind and the id of the party that owns it. ``str()`` gives the stable
    key used in storage, ``"client_available:alice"``; :meth:`parse` reads it back."""

    kind: AccountKind
    owner: str

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.owner}"

    @classmethod
    def parse(cls, key: str) -> "AccountId":
        kind, _, owner = key.partition(":")
        return cls(AccountKind(kind), owner)

    @classmethod
    def platform(cls, kind: AccountKind) -> "AccountId":
        return cls(kind, PLATFORM_OWNER)


@dataclass(frozen=True)
class Account:
    """An account and its balance (cached by storage, always equal to the sum of its entries)."""

    id: AccountId
    balance_micro: int

    @property
    def allows_negative(self) -> bool:
        return self.id.kind.allows_negative


class TransactionKind(str, enum.Enum):
    DEPOSIT = "deposit"        # payment clearing / dev grants → client available
    HOLD = "hold"              # client available → client held
    POST = "post"              # client held → provider vesting, royalties, fees; rest → available
    VOID = "void"              # client held → client available
    EXPIRE = "expire"          # client held → client available, when the hold timed out
    REFUND = "refund"          # a posted hold's payees → client available (before vesting)
    VEST = "vest"              # provider vesting → provider available
    PAYOUT = "payout"          # provider available / royalties → payment clearing
    STAKE = "stake"            # provider available → stake
    UNSTAKE = "unstake"        # provider stake → available
    SLASH = "slash"            # provider stake → platform fees
    REVERSAL = "reversal"      # the exact negation of an earlier transaction


#: Transactions a plain reversal may correct. Hold-lifecycle transactions are corrected by
#: the hold's own operations (void, expire, refund), so a hold's state never disagrees with
#: its entries.
REVERSIBLE_KINDS = frozenset({TransactionKind.DEPOSIT, TransactionKind.PAYOUT, TransactionKind.STAKE,
                              TransactionKind.UNSTAKE, TransactionKind.SLASH})


@dataclass(frozen=True)
class Entry:
    """One leg of a transaction: ``amount_micro`` added to ``account`` (negative: taken)."""

    account: AccountId
    amount_micro: int


@dataclass(frozen=True)
class Transaction:
    """An atomic movement of credits; its entries always sum to zero and are never changed."""

    id: str
    kind: TransactionKind
    created_at: datetime
    entries: tuple[Entry, ...]
    memo: str = ""
    idempotency_key: str | None = None
    hold_id: str | None = None
    reverses_id: str | None = None

    def __post_init__(self) -> None:
        if len(self.entries) < 2:
            raise ValueError(f"transaction {self.id} needs at least two entries")
        if any(type(e.amount_micro) is not int or e.amount_micro == 0 for e in self.entries):
            raise ValueError(f"transaction {self.id} has a zero or non-integer entry")
        total = sum(e.amount_micro for e in self.entries)
        if total != 0:
            raise ValueError(f"transaction {self.id} entries sum to {total}, not 0")

    def amount_for(self, account: AccountId) -> int:
        """Net micro-credits this transaction added to ``account``."""
        return sum(e.amount_micro for e in self.entries if e.account == account)


class HoldState(str, enum.Enum):
    PENDING = "pending"
    POSTED = "posted"     # fully or partly captured; the rest went back to the client
    VOIDED = "voided"
    EXPIRED = "expired"

    @property
    def resolved(self) -> bool:
        return self is not HoldState.PENDING


@dataclass(frozen=True)
class Splits:
    """How a post divides captured credits. Captured = provider + royalties + fee; whatever
    the hold reserved beyond that goes back to the client. ``publisher`` earns
    ``royalty_micro``; when a job's adapters come from several publishers, the others'
    royalties are ``other_royalties``: ((publisher, micro), ...), one leg each."""

    provider: str
    provider_micro: int
    fee_micro: int = 0
    publisher: str | None = None
    royalty_micro: int = 0
    other_royalties: tuple[tuple[str, int], ...] = ()

    @property
    def captured_micro(self) -> int:
        return (self.provider_micro + self.fee_micro + self.royalty_micro
                + sum(micro for _, micro in self.other_royalties))

    @property
    def royalty_legs(self) -> list[tuple[str, int]]:
        """Every (publisher, royalty), ``publisher``'s first."""
        return _royalty_legs(self.publisher, self.royalty_micro, self.other_royalties)


def _royalty_legs(publisher: str | None, micro: int,
                  others: tuple[tuple[str, int], ...]) -> list[tuple[str, int]]:
    return ([(publisher, micro)] if publisher is not None else []) + list(others)


@dataclass(frozen=True)
class Hold:
    """A two-phase reservation of a client's credits for a job. It resolves exactly once:
    pending → posted | voided | expired. After a post, ``vest_transaction_id`` is set when the
    provider's share vested and ``refund_transaction_id`` when the post was refunded."""

    id: str
    client: str
    job_id: str
    amount_micro: int
    state: HoldState
    created_at: datetime
    expires_at: datetime
    hold_transaction_id: str
    resolved_at: datetime | None = None
    resolve_transaction_id: str | None = None
    captured_micro: int = 0
    released_micro: int = 0
    provider: str | None = None
    provider_micro: int = 0
    publisher: str | None = None
    royalty_micro: int = 0
    fee_micro: int = 0
    vests_at: datetime | None = None
    vest_transaction_id: str | None = None
    refund_transaction_id: str | None = None
    other_royalties: tuple[tuple[str, int], ...] = ()  # see Splits

    @property
    def royalty_legs(self) -> list[tuple[str, int]]:
        """Every (publisher, royalty) the post paid, ``publisher``'s first."""
        return _royalty_legs(self.publisher, self.royalty_micro, self.other_royalties)


@dataclass(frozen=True)
class IdempotencyRecord:
    """What an idempotency key produced: ``result_type`` is ``"transaction"`` or ``"hold"``.
    ``fingerprint`` is a hash of the operation and its arguments."""

    key: str
    operation: str
    fingerprint: str
    result_type: str
    result_id: str
    created_at: datetime


class FundingSource(str, enum.Enum):
    """Where deposited credits come from."""

    PAYMENT = "payment"      # Stripe Checkout, through payment clearing
    DEV_GRANT = "dev_grant"  # an admin grant with the `dev` funding backend
    VERIFICATION = "verification"  # the platform funding a check run it sampled

    @property
    def account(self) -> AccountId:
        return AccountId.platform({FundingSource.PAYMENT: AccountKind.PLATFORM_PAYMENT_CLEARING,
                                   FundingSource.DEV_GRANT: AccountKind.PLATFORM_DEV_GRANTS,
                                   FundingSource.VERIFICATION: AccountKind.PLATFORM_VERIFICATION,
                                   }[self])


@dataclass(frozen=True)
class HistoryLine:
    """One entry of an account's history with its transaction's context."""

    transaction_id: str
    kind: TransactionKind
    created_at: datetime
    amount_micro: int
    memo: str = ""
    hold_id: str | None = None


@dataclass(frozen=True)
class TrialBalance:
    """Result of :meth:`LedgerService.verify`: the ledger is sound when ``problems`` is empty."""

    entries_total_micro: int
    transactions: int
    problems: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.problems
