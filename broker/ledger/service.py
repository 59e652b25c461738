"""LedgerService: every movement of credits in Sparecycles (DESIGN §5).

Each public operation runs in one unit of work of the repository: it validates its
arguments before touching storage, claims the idempotency key, locks what it touches
(holds first, then accounts in sorted order), refuses anything that would take an account
below zero where its kind forbids it, and appends one transaction whose entries sum to zero.
A refused operation writes nothing — not even its idempotency record, so the same request
can be retried once the cause is fixed (credits bought, say).

Idempotency: every externally triggered operation takes ``idempotency_key``. The same key
with the same operation and arguments returns the original result (the same transaction, or
the same hold as it is now) and writes nothing; the same key with anything else raises
:class:`IdempotencyConflict`. Keys share one namespace: callers should prefix them by origin
(``"stripe:evt_…"``, ``"job:<id>:post"``). ``vest`` and ``expire`` are driven by the clock
and are idempotent by nature.

The key is claimed first: its record, naming the id the result will have, is inserted
unless the key exists, in the unit of work that then does the work. A fresh key (nearly
every call) so costs one statement instead of a lookup plus an insert, and a refused
operation rolls its claim back with everything else. Only a taken key is read (a replay,
or a conflict). A concurrent request with the same key waits at its claim until the first
ends (PostgreSQL), then finds the record, instead of doing the work and failing on the
duplicate key; the claim is the first lock an operation takes, before holds and accounts.
"""
from __future__ import annotations

import hashlib
import json
import random
import time
import uuid
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Iterable, TypeVar

from broker.ledger.errors import (
    AlreadyRefunded, HoldAlreadyResolved, HoldExpired, HoldNotExpired, IdempotencyConflict,
    InsufficientCredits, InvalidAmount, InvalidArgument, LedgerBusy, NotRefundable,
    NotReversible, PostsNotBatched, UnknownAccount, UnknownHold, UnknownTransaction,
)
from broker.ledger.model import (
    CLIENT_KINDS, MAX_AMOUNT_MICRO, PLATFORM_KINDS, PROVIDER_KINDS, PUBLISHER_KINDS,
    REVERSIBLE_KINDS, Account, AccountId, AccountKind, Entry, FundingSource, HistoryLine, Hold,
    HoldState, IdempotencyRecord, Splits, Transaction, TransactionKind, TrialBalance,
)
from broker.ledger.ports import Clock, LedgerRepository, LedgerUnitOfWork, RetryableConflict

T = TypeVar("T")

MAX_ID_CHARS = 120
MAX_KEY_CHARS = 200
DEFAULT_HOLD_TTL_S = 24 * 3600
DEFAULT_VESTING_WINDOW_S = 7 * 24 * 3600


class SystemClock:
    """Wall-clock UTC time."""

    def now(self) -> datetime:
        return datetime.now(timezone.utc)


def check_amount(name: str, value: object, *, allow_zero: bool = False) -> int:
    """``value`` if it is a plain ``int`` in range; :class:`InvalidAmount` otherwise (bools,
    floats, Decimals and numeric strings are refused: money is never guessed at)."""
    low = 0 if allow_zero else 1
    allowed = f"an int from {low} to {MAX_AMOUNT_MICRO:,}"
    if type(value) is not int:
        raise InvalidAmount(name, value, allowed)
    if not low <= value <= MAX_AMOUNT_MICRO:
        raise InvalidAmount(name, value, allowed)
    return value


def _check_id(name: str, value: object, *, max_chars: int = MAX_ID_CHARS) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > max_chars:
        raise InvalidArgument(f"{name} is {value!r}; it must be a non-empty string of at most "
                              f"{max_chars} characters")
    return value


def _post_legs_of(hold: Hold, splits: Splits, released: int) -> list[tuple[AccountId, int]]:
    """The legs of posting ``hold`` for ``splits``: the held amount out, the provider's
    share, the fee and the royalty in, and ``released`` back to the client's available
    account. That account exists (the hold was taken from it), so it is named only when
    something goes back; else _move would read it to check (a post of the whole hold, as a
    cold market charges, is common)."""
    legs = [(AccountId(AccountKind.CLIENT_HELD, hold.client), -hold.amount_micro),
            (AccountId(AccountKind.PROVIDER_VESTING, splits.provider), splits.provider_micro),
            (AccountId.platform(AccountKind.PLATFORM_FEES), splits.fee_micro)]
    if released:
        legs.append((AccountId(AccountKind.CLIENT_AVAILABLE, hold.client), released))
    for publisher, micro in splits.royalty_legs:
        legs.append((AccountId(AccountKind.PUBLISHER_ROYALTIES, publisher), micro))
    return legs


def _check_royalties(splits: Splits) -> None:
    """The royalties of ``splits`` name their publishers, each once, with amounts."""
    check_amount("splits.royalty_micro", splits.royalty_micro, allow_zero=True)
    if splits.royalty_micro and splits.publisher is None:
        raise InvalidArgument("splits.royalty_micro is set but splits.publisher is None; "
                              "name the publisher that earns the royalty")
    if splits.publisher is not None:
        _check_id("splits.publisher", splits.publisher)
    if not isinstance(splits.other_royalties, tuple):
        raise InvalidArgument(f"splits.other_royalties is {splits.other_royalties!r}; it "
                              "must be a tuple of (publisher, micro) pairs")
    if splits.other_royalties and splits.publisher is None:
        raise InvalidArgument("splits.other_royalties is set but splits.publisher is None; "
                              "the first publisher goes in publisher and royalty_micro")
    seen = {splits.publisher}
    for i, pair in enumerate(splits.other_royalties):
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise InvalidArgument(f"splits.other_royalties[{i}] is {pair!r}; it must be a "
                                  "(publisher, micro) pair")
        publisher, micro = pair
        _check_id(f"splits.other_royalties[{i}] publisher", publisher)
        check_amount(f"splits.other_royalties[{i}] micro", micro)
        if publisher in seen:
            raise InvalidArgument(f"splits.other_royalties[{i}] names publisher {publisher!r} "
                                  "again; each publisher earns one royalty leg (sum theirs)")
        seen.add(publisher)


def _royalty_payload(splits: Splits) -> dict[str, Any]:
    """The royalty part of a post's fingerprint: empty when there are no other publishers,
    so the records of posts made before other_royalties existed keep matching."""
    if not splits.other_royalties:
        return {}
    return {"other_royalties": [[p, m] for p, m in splits.other_royalties]}


# ``json.dumps`` with options builds a JSONEncoder per call; this one is built once and
# encodes exactly as ``json.dumps(…, sort_keys=True, separators=(",", ":"))`` did (stored
# fingerprints must keep matching).
_FINGERPRINT_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":")).encode


def _fingerprint(operation: str, payload: dict[str, Any]) -> str:
    return hashlib.sha256(_FINGERPRINT_JSON({"op": operation, **payload}).encode()).hexdigest()


def _new_id() -> str:
    return uuid.uuid4().hex


class LedgerService:
    """The ledger's operations. ``repo`` is a :class:`LedgerRepository`; ``clock`` gives the
    time (a fake one in tests); ``vesting_window_s`` is how long a provider's earnings stay
    claw-back-able before :meth:`vest` makes them available."""

    def __init__(self, repo: LedgerRepository, *, clock: Clock | None = None,
                 vesting_window_s: int = DEFAULT_VESTING_WINDOW_S, max_attempts: int = 8):
        self.repo = repo
        self.clock = clock or SystemClock()
        self.vesting_window_s = vesting_window_s
        self.max_attempts = max_attempts

    # ------------------------------------------------------------------ accounts

    def open_platform_accounts(self) -> None:
        """Create the platform's accounts (fees, payment clearing, dev grants); idempotent."""
        self._open([AccountId.platform(k) for k in PLATFORM_KINDS])

    def open_client(self, client: str) -> None:
        """Create a client's available and held accounts; idempotent."""
        self._open([AccountId(k, _check_id("client", client)) for k in CLIENT_KINDS])

    def open_provider(self, provider: str) -> None:
        """Create a provider's vesting, available and stake accounts; idempotent."""
        self._open([AccountId(k, _check_id("provider", provider)) for k in PROVIDER_KINDS])

    def open_publisher(self, publisher: str) -> None:
        """Create a plugin publisher's royalties account; idempotent."""
        self._open([AccountId(k, _check_id("publisher", publisher)) for k in PUBLISHER_KINDS])

    def _open(self, accounts: list[AccountId]) -> None:
        def work(uow: LedgerUnitOfWork) -> None:
            uow.add_accounts(accounts)
        self._retrying(work)

    # ------------------------------------------------------------------ money in

    def deposit(self, client: str, amount_micro: int, *, idempotency_key: str,
                source: FundingSource = FundingSource.PAYMENT, memo: str = "") -> Transaction:
        """Credit a client's available balance: a cleared payment (key: the Stripe event id)
        or, with the ``dev`` funding backend, an admin grant."""
        _check_id("client", client)
        check_amount("amount_micro", amount_micro)
        if not isinstance(source, FundingSource):
            raise InvalidArgument(f"source is {source!r}; it must be a FundingSource")
        payload = {"client": client, "amount_micro": amount_micro, "source": source.value, "memo": memo}

        def work(uow: LedgerUnitOfWork, txn_id: str) -> Transaction:
            return self._move(uow, TransactionKind.DEPOSIT, [
                (source.account, -amount_micro),
                (AccountId(AccountKind.CLIENT_AVAILABLE, client), amount_micro),
            ], memo=memo, key=idempotency_key, txn_id=txn_id)
        return self._idempotent("deposit", idempotency_key, payload, work)

    # ------------------------------------------------------------------ holds

    def hold(self, client: str, amount_micro: int, job_id: str, *, idempotency_key: str,
             ttl_s: int = DEFAULT_HOLD_TTL_S) -> Hold:
        """Reserve ``amount_micro`` of the client's available credits for a job (its maximum
        price). Raises :class:`InsufficientCredits` (HTTP 402) when the balance is short."""
        _check_id("client", client)
        _check_id("job_id", job_id)
        check_amount("amount_micro", amount_micro)
        if type(ttl_s) is not int or ttl_s <= 0:
            raise InvalidArgument(f"ttl_s is {ttl_s!r}; it must be a positive int of seconds")
        payload = {"client": client, "amount_micro": amount_micro, "job_id": job_id, "ttl_s": ttl_s}

        def work(uow: LedgerUnitOfWork, hold_id: str) -> Hold:
            now = self.clock.now()
            txn = self._move(uow, TransactionKind.HOLD, [
                (AccountId(AccountKind.CLIENT_AVAILABLE, client), -amount_micro),
                (AccountId(AccountKind.CLIENT_HELD, client), amount_micro),
            ], memo=f"job {job_id}", key=idempotency_key, hold_id=hold_id, now=now)
            hold = Hold(id=hold_id, client=client, job_id=job_id, amount_micro=amount_micro,
                        state=HoldState.PENDING, created_at=now,
                        expires_at=now + timedelta(seconds=ttl_s), hold_transaction_id=txn.id)
            uow.add_hold(hold)
            return hold
        return self._idempotent("hold", idempotency_key, payload, work, result_type="hold")

    def post(self, hold_id: str, splits: Splits, *, idempotency_key: str,
             vesting_window_s: int | None = None) -> Transaction:
        """Settle a pending hold: the provider's share goes to its vesting account, the
        royalty to the publisher, the fee to the platform, and whatever the hold reserved
        beyond their sum back to the client (a partial post). Resolves the hold. The share
        vests after ``vesting_window_s`` (default: the service's window)."""
        payload, window_s = self._post_args(hold_id, splits, vesting_window_s)

        def work(uow: LedgerUnitOfWork, txn_id: str) -> Transaction:
            now = self.clock.now()
            # The hold is resolved first, by one conditional write (it locks the hold, as
            # _pending_hold would); when it is not pending, has expired or is too small,
            # nothing is written, and reading it says which.
            hold = uow.post_hold(hold_id, now=now, transaction_id=txn_id, splits=splits,
                                 vests_at=now + timedelta(seconds=window_s))
            if hold is None:
                hold = self._pending_hold(uow, hold_id, "post")
                if now >= hold.expires_at:
                    raise HoldExpired(hold_id)
                if splits.captured_micro > hold.amount_micro:
                    raise InvalidAmount("splits captured total", splits.captured_micro,
                                        f"at most the hold's {hold.amount_micro:,}")
                # Postable now: committed by another transaction after post_hold looked.
                raise RetryableConflict(f"hold {hold_id} changed while it was posted")
            return self._move(uow, TransactionKind.POST,
                              _post_legs_of(hold, splits, hold.released_micro),
                              memo=f"job {hold.job_id}", key=idempotency_key, hold_id=hold_id,
                              now=now, txn_id=txn_id)
        return self._idempotent("post", idempotency_key, payload, work)

    def _post_args(self, hold_id: str, splits: Splits,
                   vesting_window_s: int | None) -> tuple[dict[str, Any], int]:
        """A post's arguments checked: (its fingerprint's payload, its vesting window)."""
        _check_id("hold_id", hold_id)
        if vesting_window_s is not None and (type(vesting_window_s) is not int
                                             or vesting_window_s < 0):
            raise InvalidArgument(f"vesting_window_s is {vesting_window_s!r}; it must be an int "
                                  ">= 0 of seconds")
        window_s = self.vesting_window_s if vesting_window_s is None else vesting_window_s
        if not isinstance(splits, Splits):
            raise InvalidArgument(f"splits is {splits!r}; it must be a Splits")
        _check_id("splits.provider", splits.provider)
        check_amount("splits.provider_micro", splits.provider_micro, allow_zero=True)
        check_amount("splits.fee_micro", splits.fee_micro, allow_zero=True)
        _check_royalties(splits)
        if splits.captured_micro == 0:
            raise InvalidAmount("splits captured total", 0,
                                "positive (to release a hold without charging, void it)")
        payload = {"hold_id": hold_id, "provider": splits.provider,
                   "provider_micro": splits.provider_micro, "fee_micro": splits.fee_micro,
                   "publisher": splits.publisher, "royalty_micro": splits.royalty_micro,
                   **_royalty_payload(splits)}
        if vesting_window_s is not None:
            payload["vesting_window_s"] = vesting_window_s
        return payload, window_s

    def post_many(self, posts: list[tuple[str, Splits, str, int | None]]) -> list[Transaction]:
        """Several posts, each ``(hold_id, splits, idempotency_key, vesting_window_s)`` as
        :meth:`post` takes them, made in one unit of work with the statements of one post
        (issue #28): one claim of every key, the holds posted together, one lock of every
        account they move, and their transactions, entries and balances each written once
        for all of them (an account's balance moved once by the sum of its legs). The
        result is what the same posts made one after another would leave, overdraft checks
        included (each post's legs checked against the balances the earlier ones left).
        All or nothing: a key already taken (a replay, a conflict), a hold that is not
        postable, a missing account or a refused leg writes nothing and raises
        (:class:`PostsNotBatched` for the first two); the caller then makes the posts one
        at a time, where :meth:`post` answers each on its own."""
        if not posts:
            return []
        checked = []  # (hold_id, splits, key, window_s, fingerprint)
        for hold_id, splits, key, vesting_window_s in posts:
            payload, window_s = self._post_args(hold_id, splits, vesting_window_s)
            _check_id("idempotency_key", key, max_chars=MAX_KEY_CHARS)
            checked.append((hold_id, splits, key, window_s, _fingerprint("post", payload)))
        if len({c[2] for c in checked}) < len(checked) or len({c[0] for c in checked}) < len(checked):
            raise InvalidArgument("post_many names a key or a hold twice; post them one at a time")

        def work(uow: LedgerUnitOfWork) -> list[Transaction]:
            now = self.clock.now()
            records = [IdempotencyRecord(key=key, operation="post", fingerprint=fp,
                                         result_type="transaction", result_id=_new_id(),
                                         created_at=now)
                       for _, _, key, _, fp in checked]
            if uow.add_idempotencies(records) != len(records):
                raise PostsNotBatched("an idempotency key of the batch is taken")
            holds = uow.post_holds([(hold_id, r.result_id, splits,
                                     now + timedelta(seconds=window_s))
                                    for (hold_id, splits, _, window_s, _), r
                                    in zip(checked, records)], now=now)
            if any(h is None for h in holds):
                raise PostsNotBatched("a hold of the batch is not postable")
            return self._move_many(uow, [
                (TransactionKind.POST, _post_legs_of(hold, splits, hold.released_micro),
                 f"job {hold.job_id}", key, hold.id, r.result_id)
                for hold, (_, splits, key, _, _), r in zip(holds, checked, records)], now=now)
        return self._retrying(work)

    def post_shared(self, hold_id: str, splits: Splits, earlier: list[Splits], *,
                    idempotency_key: str, vesting_window_s: int | None = None) -> Transaction:
        """Settle a pending hold for a job that several providers worked on in turn (a job
        resumed from a checkpoint): ``splits`` pays the provider that finished it, and the
        job's royalties when it carries any; each of ``earlier`` pays one provider that did
        a part before (no royalty: the job pays them once). All in one transaction of the
        ledger: the hold is posted for ``splits`` (the rest released to the client), then
        each earlier share is held from that released rest and posted at once, so every
        hold still has one provider (vesting and refunds work per hold; refunding the main
        hold returns the royalties) and the client pays at most the original hold. Returns
        the post of the main hold; idempotent like :meth:`post`."""
        _check_id("hold_id", hold_id)
        if vesting_window_s is not None and (type(vesting_window_s) is not int
                                             or vesting_window_s < 0):
            raise InvalidArgument(f"vesting_window_s is {vesting_window_s!r}; it must be an int "
                                  ">= 0 of seconds")
        window_s = self.vesting_window_s if vesting_window_s is None else vesting_window_s
        every = [splits, *earlier]
        for i, sp in enumerate(every):
            if not isinstance(sp, Splits):
                raise InvalidArgument(f"splits #{i} is {sp!r}; it must be a Splits")
            _check_id("splits.provider", sp.provider)
            check_amount("splits.provider_micro", sp.provider_micro, allow_zero=True)
            check_amount("splits.fee_micro", sp.fee_micro, allow_zero=True)
            if i > 0 and (sp.royalty_micro or sp.publisher is not None or sp.other_royalties):
                raise InvalidArgument(f"earlier splits #{i} carry a royalty; a job pays its "
                                      "royalty once, with the main splits")
            if sp.captured_micro == 0 and i > 0:
                raise InvalidAmount("earlier splits captured total", 0, "positive")
        _check_royalties(splits)
        if splits.captured_micro == 0:
            raise InvalidAmount("splits captured total", 0,
                                "positive (to release a hold without charging, void it)")
        payload = {"hold_id": hold_id, "shares": [
            [sp.provider, sp.provider_micro, sp.fee_micro] for sp in every]}
        if splits.publisher is not None:  # (absent otherwise: older keys keep their prints)
            payload["royalty"] = [splits.publisher, splits.royalty_micro]
            payload.update(_royalty_payload(splits))
        if vesting_window_s is not None:
            payload["vesting_window_s"] = vesting_window_s

        def work(uow: LedgerUnitOfWork, txn_id: str) -> Transaction:
            now = self.clock.now()
            hold = self._pending_hold(uow, hold_id, "post")
            if now >= hold.expires_at:
                raise HoldExpired(hold_id)
            total = sum(sp.captured_micro for sp in every)
            if total > hold.amount_micro:
                raise InvalidAmount("splits captured total", total,
                                    f"at most the hold's {hold.amount_micro:,}")
            held = AccountId(AccountKind.CLIENT_HELD, hold.client)
            available = AccountId(AccountKind.CLIENT_AVAILABLE, hold.client)
            main = self._post_legs(uow, hold, splits, key=idempotency_key, now=now,
                                   window_s=window_s, txn_id=txn_id)
            for i, sp in enumerate(earlier):
                part = Hold(id=_new_id(), client=hold.client, job_id=hold.job_id,
                            amount_micro=sp.captured_micro, state=HoldState.PENDING,
                            created_at=now, expires_at=hold.expires_at, hold_transaction_id="")
                txn = self._move(uow, TransactionKind.HOLD, [
                    (available, -sp.captured_micro), (held, sp.captured_micro),
                ], memo=f"job {hold.job_id} (part {i + 1})", key=None, hold_id=part.id, now=now)
                part = replace(part, hold_transaction_id=txn.id)
                uow.add_hold(part)
                self._post_legs(uow, part, sp, key=None, now=now, window_s=window_s)
            return main
        return self._idempotent("post_shared", idempotency_key, payload, work)

    def _post_legs(self, uow: LedgerUnitOfWork, hold: Hold, splits: Splits, *, key: str | None,
                   now: datetime, window_s: int, txn_id: str | None = None) -> Transaction:
        released = hold.amount_micro - splits.captured_micro
        txn = self._move(uow, TransactionKind.POST, _post_legs_of(hold, splits, released),
                         memo=f"job {hold.job_id}", key=key, hold_id=hold.id, now=now,
                         txn_id=txn_id)
        uow.save_hold(replace(
            hold, state=HoldState.POSTED, resolved_at=now, resolve_transaction_id=txn.id,
            captured_micro=splits.captured_micro, released_micro=released,
            provider=splits.provider, provider_micro=splits.provider_micro,
            publisher=splits.publisher, royalty_micro=splits.royalty_micro,
            other_royalties=splits.other_royalties, fee_micro=splits.fee_micro,
            vests_at=now + timedelta(seconds=window_s)))
        return txn

    def void(self, hold_id: str, *, idempotency_key: str, reason: str = "") -> Transaction:
        """Release a pending hold entirely back to the client (job cancelled or failed
        before any work was earned)."""
        _check_id("hold_id", hold_id)

        def work(uow: LedgerUnitOfWork, txn_id: str) -> Transaction:
            return self._release(uow, hold_id, TransactionKind.VOID, HoldState.VOIDED,
                                 memo=reason, key=idempotency_key, txn_id=txn_id)
        return self._idempotent("void", idempotency_key, {"hold_id": hold_id, "reason": reason}, work)

    def expire(self, hold_id: str) -> Transaction:
        """Release a pending hold whose time ran out. Expiring an already expired hold
        returns its expiry transaction; a hold resolved otherwise is refused."""
        _check_id("hold_id", hold_id)

        def work(uow: LedgerUnitOfWork) -> Transaction:
            hold = uow.get_hold(hold_id, for_update=True)
            if hold is not None and hold.state is HoldState.EXPIRED:
                return self._transaction(uow, hold.resolve_transaction_id)
            now = self.clock.now()
            if hold is not None and hold.state is HoldState.PENDING and now < hold.expires_at:
                raise HoldNotExpired(hold_id, hold.expires_at.isoformat())
            return self._release(uow, hold_id, TransactionKind.EXPIRE, HoldState.EXPIRED,
                                 memo="hold expired", key=None, now=now)
        return self._retrying(work)

    def expire_due(self, *, limit: int = 100) -> list[Transaction]:
        """Expire up to ``limit`` pending holds whose time ran out (a periodic sweeper)."""
        with self.repo.unit_of_work() as uow:
            due = uow.due_hold_ids(self.clock.now(), limit=limit)
        done = []
        for hold_id in due:
            try:
                done.append(self.expire(hold_id))
            except HoldAlreadyResolved:  # posted or voided meanwhile: nothing to do
                continue
        return done

    def refund(self, hold_id: str, *, idempotency_key: str, reason: str = "") -> Transaction:
        """Give a posted hold's captured credits back to the client, taken from the provider's
        vesting balance, the publisher's royalties and the platform's fees (a dispute lost, a
        cancelled job). Only before the provider's share has vested; at most once."""
        _check_id("hold_id", hold_id)

        def work(uow: LedgerUnitOfWork, txn_id: str) -> Transaction:
            hold = uow.get_hold(hold_id, for_update=True)
            if hold is None:
                raise UnknownHold(hold_id)
            if hold.state is not HoldState.POSTED:
                raise NotRefundable(f"hold {hold_id} is {hold.state.value}; only posted holds are "
                                    "refunded (a pending hold is voided)")
            if hold.refund_transaction_id is not None:
                raise AlreadyRefunded(hold_id, hold.refund_transaction_id)
            if hold.vest_transaction_id is not None:
                raise NotRefundable(f"hold {hold_id}'s provider share has vested (transaction "
                                    f"{hold.vest_transaction_id}); refunds end with the vesting "
                                    "window: slash() the provider's stake and credit the client "
                                    "with a deposit instead")
            legs = [(AccountId(AccountKind.CLIENT_AVAILABLE, hold.client), hold.captured_micro),
                    (AccountId(AccountKind.PROVIDER_VESTING, hold.provider), -hold.provider_micro),
                    (AccountId.platform(AccountKind.PLATFORM_FEES), -hold.fee_micro)]
            for publisher, micro in hold.royalty_legs:
                legs.append((AccountId(AccountKind.PUBLISHER_ROYALTIES, publisher), -micro))
            txn = self._move(uow, TransactionKind.REFUND, legs, memo=reason,
                             key=idempotency_key, hold_id=hold_id, txn_id=txn_id)
            uow.save_hold(replace(hold, refund_transaction_id=txn.id))
            return txn
        return self._idempotent("refund", idempotency_key, {"hold_id": hold_id, "reason": reason}, work)

    def vest(self, provider: str) -> Transaction | None:
        """Move every posted share of ``provider`` whose vesting window has passed from
        vesting to available, in one transaction; ``None`` when nothing is due."""
        _check_id("provider", provider)

        def work(uow: LedgerUnitOfWork) -> Transaction | None:
            now = self.clock.now()
            holds = uow.unvested_holds(provider, due_by=now, lock=True)
            total = sum(h.provider_micro for h in holds)
            if total == 0:
                return None
            txn = self._move(uow, TransactionKind.VEST, [
                (AccountId(AccountKind.PROVIDER_VESTING, provider), -total),
                (AccountId(AccountKind.PROVIDER_AVAILABLE, provider), total),
            ], memo=f"{len(holds)} settled job(s) vested", key=None, now=now)
            for h in holds:
                uow.save_hold(replace(h, vest_transaction_id=txn.id))
            return txn
        return self._retrying(work)

    # ------------------------------------------------------------------ money out, stake

    def payout(self, account: AccountId, amount_micro: int, *, idempotency_key: str,
               memo: str = "") -> Transaction:
        """Pay credits out of a provider's available balance or a publisher's royalties to
        payment clearing (a Stripe Connect transfer). If the transfer fails, call
        :meth:`reverse` on the returned transaction."""
        if not isinstance(account, AccountId) or account.kind not in (
                AccountKind.PROVIDER_AVAILABLE, AccountKind.PUBLISHER_ROYALTIES):
            raise InvalidArgument(f"cannot pay out of {account}; payouts come from "
                                  "provider_available or publisher_royalties accounts")
        _check_id("account.owner", account.owner)
        check_amount("amount_micro", amount_micro)
        payload = {"account": str(account), "amount_micro": amount_micro, "memo": memo}

        def work(uow: LedgerUnitOfWork, txn_id: str) -> Transaction:
            return self._move(uow, TransactionKind.PAYOUT, [
                (account, -amount_micro),
                (AccountId.platform(AccountKind.PLATFORM_PAYMENT_CLEARING), amount_micro),
            ], memo=memo, key=idempotency_key, txn_id=txn_id)
        return self._idempotent("payout", idempotency_key, payload, work)

    def stake(self, provider: str, amount_micro: int, *, idempotency_key: str) -> Transaction:
        """Put some of a provider's available credits at stake."""
        return self._provider_move("stake", TransactionKind.STAKE, provider, amount_micro,
                                   AccountKind.PROVIDER_AVAILABLE, AccountKind.PROVIDER_STAKE,
                                   idempotency_key, "")

    def unstake(self, provider: str, amount_micro: int, *, idempotency_key: str) -> Transaction:
        """Return staked credits to the provider's available balance."""
        return self._provider_move("unstake", TransactionKind.UNSTAKE, provider, amount_micro,
                                   AccountKind.PROVIDER_STAKE, AccountKind.PROVIDER_AVAILABLE,
                                   idempotency_key, "")

    def slash(self, provider: str, amount_micro: int, *, idempotency_key: str,
              reason: str = "") -> Transaction:
        """Forfeit part of a provider's stake to the platform (verification found cheating)."""
        return self._provider_move("slash", TransactionKind.SLASH, provider, amount_micro,
                                   AccountKind.PROVIDER_STAKE, AccountKind.PLATFORM_FEES,
                                   idempotency_key, reason)

    def _provider_move(self, operation: str, kind: TransactionKind, provider: str, amount_micro: int,
                       source: AccountKind, destination: AccountKind, key: str, memo: str
                       ) -> Transaction:
        _check_id("provider", provider)
        check_amount("amount_micro", amount_micro)
        dest = (AccountId.platform(destination) if destination.is_platform
                else AccountId(destination, provider))
        payload = {"provider": provider, "amount_micro": amount_micro, "memo": memo}

        def work(uow: LedgerUnitOfWork, txn_id: str) -> Transaction:
            return self._move(uow, kind, [(AccountId(source, provider), -amount_micro),
                                          (dest, amount_micro)], memo=memo, key=key,
                              txn_id=txn_id)
        return self._idempotent(operation, key, payload, work)

    # ------------------------------------------------------------------ corrections

    def reverse(self, transaction_id: str, *, idempotency_key: str, reason: str) -> Transaction:
        """Append the exact negation of a deposit, payout, stake, unstake or slash (a
        chargeback, a failed transfer, an admin correction). Entries are never changed; a
        transaction is reversed at most once, and reversals are not themselves reversed
        (redo the original operation instead)."""
        _check_id("transaction_id", transaction_id)
        if not isinstance(reason, str) or not reason.strip():
            raise InvalidArgument("reason is required: say why the transaction is reversed")

        def work(uow: LedgerUnitOfWork, txn_id: str) -> Transaction:
            original = self._transaction(uow, transaction_id)
            if original.kind not in REVERSIBLE_KINDS:
                raise NotReversible(
                    f"transaction {transaction_id} is a {original.kind.value}; hold transactions "
                    "are corrected with void, expire or refund, and a reversal by redoing the "
                    "original operation")
            already = uow.reversal_of(transaction_id)
            if already is not None:
                raise NotReversible(f"transaction {transaction_id} was already reversed by "
                                    f"{already.id}")
            return self._move(uow, TransactionKind.REVERSAL,
                              [(e.account, -e.amount_micro) for e in original.entries],
                              memo=reason, key=idempotency_key, reverses_id=transaction_id,
                              txn_id=txn_id)
        payload = {"transaction_id": transaction_id, "reason": reason}
        return self._idempotent("reverse", idempotency_key, payload, work)

    # ------------------------------------------------------------------ reads

    def balance(self, account: AccountId) -> int:
        """The account's balance in micro-credits; :class:`UnknownAccount` if it does not exist."""
        with self.repo.unit_of_work() as uow:
            found = uow.get_accounts([account]).get(account)
        if found is None:
            raise UnknownAccount(account)
        return found.balance_micro

    def balances(self, owner: str) -> dict[AccountKind, int]:
        """Every account of ``owner`` (``"platform"`` for the platform's) by kind."""
        _check_id("owner", owner)
        with self.repo.unit_of_work() as uow:
            return {a.id.kind: a.balance_micro for a in uow.accounts_of(owner)}

    def history(self, account: AccountId, *, limit: int = 100) -> list[HistoryLine]:
        """The account's entries, newest first."""
        if type(limit) is not int or not 1 <= limit <= 10_000:
            raise InvalidArgument(f"limit is {limit!r}; it must be an int from 1 to 10,000")
        with self.repo.unit_of_work() as uow:
            if account not in uow.get_accounts([account]):
                raise UnknownAccount(account)
            return uow.history(account, limit=limit)

    def get_hold(self, hold_id: str) -> Hold:
        with self.repo.unit_of_work() as uow:
            hold = uow.get_hold(hold_id)
        if hold is None:
            raise UnknownHold(hold_id)
        return hold

    def unvested_holds(self, provider: str) -> list[Hold]:
        """The posted holds whose share of ``provider`` has neither vested nor been
        refunded: what a claw-back can still give back to the clients."""
        _check_id("provider", provider)
        with self.repo.unit_of_work() as uow:
            return uow.unvested_holds(provider)

    def get_transaction(self, transaction_id: str) -> Transaction:
        with self.repo.unit_of_work() as uow:
            return self._transaction(uow, transaction_id)

    def verify(self) -> TrialBalance:
        """Audit the whole ledger: entries sum to zero overall and per transaction, cached
        balances equal their entries, no forbidden negative balance."""
        with self.repo.unit_of_work() as uow:
            total, count, problems = uow.audit()
        if total != 0:
            problems = [f"all entries sum to {total}, not 0", *problems]
        return TrialBalance(entries_total_micro=total, transactions=count, problems=tuple(problems))

    # ------------------------------------------------------------------ internals

    def _move(self, uow: LedgerUnitOfWork, kind: TransactionKind,
              legs: Iterable[tuple[AccountId, int]], *, memo: str, key: str | None,
              hold_id: str | None = None, reverses_id: str | None = None,
              now: datetime | None = None, txn_id: str | None = None) -> Transaction:
        """Lock the legs' accounts, refuse a forbidden overdraft, append the transaction
        (``txn_id``: the id an idempotency record already names, else a new one)."""
        net: dict[AccountId, int] = {}
        for account, amount in legs:
            net[account] = net.get(account, 0) + amount
        entries = tuple(Entry(a, amt) for a, amt in sorted(net.items()) if amt != 0)
        moved = [e.account for e in entries]
        # Lock only what moves (a post without a fee leaves the hot platform row alone),
        # but every named account must exist: a zero royalty to an unknown publisher is a bug.
        locked = uow.lock_accounts(moved)
        known = locked
        if len(moved) < len(net):
            known = {**locked, **uow.get_accounts(sorted(set(net) - set(moved)))}
        if len(known) < len(net):  # some are missing: name the first, in sorted order
            for account_id in sorted(net):
                if account_id not in known:
                    raise UnknownAccount(account_id)
        for entry in entries:
            account: Account = locked[entry.account]
            if (entry.amount_micro < 0 and not account.allows_negative
                    and account.balance_micro + entry.amount_micro < 0):
                raise InsufficientCredits(entry.account, needed_micro=-entry.amount_micro,
                                          available_micro=account.balance_micro)
        txn = Transaction(id=txn_id or _new_id(), kind=kind, created_at=now or self.clock.now(),
                          entries=entries, memo=memo, idempotency_key=key, hold_id=hold_id,
                          reverses_id=reverses_id)
        uow.add_transaction(txn)
        return txn

    def _move_many(self, uow: LedgerUnitOfWork,
                   moves: list[tuple[TransactionKind, list[tuple[AccountId, int]], str, str | None,
                                     str | None, str]],
                   *, now: datetime) -> list[Transaction]:
        """:meth:`_move` for each of ``moves`` (kind, legs, memo, key, hold id, transaction
        id), in order, with one lock of all their accounts and one write of all their
        transactions (see :meth:`LedgerUnitOfWork.add_transactions`)."""
        txns, every = [], set()
        for kind, legs, memo, key, hold_id, txn_id in moves:
            net: dict[AccountId, int] = {}
            for account, amount in legs:
                net[account] = net.get(account, 0) + amount
            every.update(net)
            txns.append((Transaction(
                id=txn_id, kind=kind, created_at=now, memo=memo, idempotency_key=key,
                hold_id=hold_id,
                entries=tuple(Entry(a, amt) for a, amt in sorted(net.items()) if amt != 0)),
                net))
        moved = sorted({e.account for t, _ in txns for e in t.entries})
        locked = uow.lock_accounts(moved)
        known = locked
        if len(moved) < len(every):
            known = {**locked, **uow.get_accounts(sorted(every - set(moved)))}
        balances = {a: acct.balance_micro for a, acct in locked.items()}
        for txn, net in txns:  # in order, as the moves one after another would check them
            for account_id in sorted(net):
                if account_id not in known:
                    raise UnknownAccount(account_id)
            for entry in txn.entries:
                have = balances[entry.account]
                if (entry.amount_micro < 0 and not locked[entry.account].allows_negative
                        and have + entry.amount_micro < 0):
                    raise InsufficientCredits(entry.account, needed_micro=-entry.amount_micro,
                                              available_micro=have)
                balances[entry.account] = have + entry.amount_micro
        result = [t for t, _ in txns]
        uow.add_transactions(result)
        return result

    def _pending_hold(self, uow: LedgerUnitOfWork, hold_id: str, wanted: str) -> Hold:
        hold = uow.get_hold(hold_id, for_update=True)
        if hold is None:
            raise UnknownHold(hold_id)
        if hold.state.resolved:
            raise HoldAlreadyResolved(hold_id, hold.state, wanted)
        return hold

    def _release(self, uow: LedgerUnitOfWork, hold_id: str, kind: TransactionKind,
                 state: HoldState, *, memo: str, key: str | None,
                 now: datetime | None = None, txn_id: str | None = None) -> Transaction:
        now = now or self.clock.now()
        hold = self._pending_hold(uow, hold_id, "void" if state is HoldState.VOIDED else "expire")
        txn = self._move(uow, kind, [
            (AccountId(AccountKind.CLIENT_HELD, hold.client), -hold.amount_micro),
            (AccountId(AccountKind.CLIENT_AVAILABLE, hold.client), hold.amount_micro),
        ], memo=memo, key=key, hold_id=hold_id, now=now, txn_id=txn_id)
        uow.save_hold(replace(hold, state=state, resolved_at=now, resolve_transaction_id=txn.id,
                              released_micro=hold.amount_micro))
        return txn

    @staticmethod
    def _transaction(uow: LedgerUnitOfWork, transaction_id: str | None) -> Transaction:
        txn = uow.get_transaction(transaction_id) if transaction_id else None
        if txn is None:
            raise UnknownTransaction(str(transaction_id))
        return txn

    def _idempotent(self, operation: str, key: str, payload: dict[str, Any],
                    work: Callable[[LedgerUnitOfWork, str], T], *,
                    result_type: str = "transaction") -> T:
        """Run ``work(uow, result_id)`` once per key: it must return a result (a
        ``result_type``, "transaction" or "hold") whose id is ``result_id``, which the key's
        record names before the work runs (see the module's docstring)."""
        _check_id("idempotency_key", key, max_chars=MAX_KEY_CHARS)
        fingerprint = _fingerprint(operation, payload)

        def guarded(uow: LedgerUnitOfWork) -> T:
            record = IdempotencyRecord(key=key, operation=operation, fingerprint=fingerprint,
                                       result_type=result_type, result_id=_new_id(),
                                       created_at=self.clock.now())
            if uow.add_idempotency(record):
                result = work(uow, record.result_id)
                assert result.id == record.result_id, (  # type: ignore[attr-defined]
                    f"{operation} returned {result.id}, not the id its key's record names")
                return result
            record = uow.get_idempotency(key)
            if record is None:  # taken by a writer whose record this snapshot cannot see
                raise RetryableConflict(f"idempotency key {key} is taken by another writer")
            if record.fingerprint != fingerprint:
                raise IdempotencyConflict(key, record.operation)
            if record.result_type == "hold":
                hold = uow.get_hold(record.result_id)
                assert hold is not None, f"idempotency record {key} names a missing hold"
                return hold  # type: ignore[return-value]
            return self._transaction(uow, record.result_id)  # type: ignore[return-value]
        return self._retrying(guarded)

    def _retrying(self, work: Callable[[LedgerUnitOfWork], T]) -> T:
        for attempt in range(self.max_attempts):
            try:
                with self.repo.unit_of_work() as uow:
                    return work(uow)
            except RetryableConflict:
                time.sleep(min(0.2, 0.005 * 2 ** attempt) * random.random())
        raise LedgerBusy(f"the ledger stayed busy through {self.max_attempts} attempts; nothing "
                         "was written, retry the request with the same idempotency key")
