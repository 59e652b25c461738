"""PaymentService: buying credits, granting them in dev mode, paying providers out.

Money in (Stripe Checkout): the client asks for a session and pays on Stripe's page; Stripe
then sends ``checkout.session.completed`` (and, for delayed methods,
``checkout.session.async_payment_succeeded``). The webhook is verified on the raw body,
the session is re-fetched from Stripe (an event's copy may be stale or out of order), and
once it is paid the client's credits are deposited with the ledger idempotency key
``stripe:<session id>``: the key is checked in the same database transaction as the deposit,
so a repeated event, the completed/async pair of one session, or two deliveries racing
each other credit the session exactly once. (Keying on the session rather than the event id
is what makes the pair safe: both events name the same session.)

Money out (Stripe Connect): the ledger payout moves the provider's available credits to
payment clearing first, then the transfer is made with the payout's id as Stripe's
idempotency key; if Stripe refuses it, or later reports ``transfer.reversed``, the payout is
reversed in the ledger and the credits are available again.
"""
from __future__ import annotations

import logging
import time
import uuid
from decimal import Decimal, InvalidOperation
from typing import Protocol

from broker.errors import NotFound
from broker.ledger import errors as lerr
from broker.ledger.model import MICRO_PER_CREDIT, AccountId, AccountKind, FundingSource, Transaction
from broker.ledger.service import LedgerService
from broker.payments.errors import (
    FundingNotConfigured, InvalidPaymentAmount, NotDevFunding, PaymentProviderError,
    PayoutAccountMissing, WebhookRefused,
)
from broker.payments.model import Payout
from broker.payments.ports import GatewayError, PaymentGateway, PaymentsRepository, SignatureError

log = logging.getLogger(__name__)

PAID_EVENTS = frozenset({"checkout.session.completed", "checkout.session.async_payment_succeeded"})
MAX_CREDITS_PER_CHECKOUT = 10_000_000


def credits_to_micro(value: object, *, field: str = "credits") -> int:
    """A positive credit amount (int, or a decimal string like ``"2.5"``) in micro-credits;
    refuses floats, fractions of a micro-credit, zero and negatives."""
    if isinstance(value, bool) or isinstance(value, float) or not isinstance(value, (int, str)):
        raise InvalidPaymentAmount(f"{field} is {value!r}; send an integer or a decimal string "
                                   'like "2.5"', field=field)
    try:
        micro = Decimal(str(value)) * MICRO_PER_CREDIT
    except InvalidOperation:
        raise InvalidPaymentAmount(f"{field} is {value!r}; it is not a number", field=field) from None
    if micro != micro.to_integral_value() or micro <= 0 or micro > 10**9 * MICRO_PER_CREDIT:
        raise InvalidPaymentAmount(f"{field} is {value!r}; it must be positive, at most a billion, "
                                   "with at most 6 decimals", field=field)
    return int(micro)



class Links(Protocol):
    """Where the payment service reports what links accounts (``broker.links``)."""

    def record(self, account_id: str, kind: str, value: str, label: str = "") -> None: ...


class PaymentService:
    def __init__(self, ledger: LedgerService, repo: PaymentsRepository,
                 gateway: PaymentGateway | None, *, credit_price_cents: int = 1,
                 currency: str = "usd", public_url: str = "http://127.0.0.1:8080",
                 account_exists=lambda account_id: True, clock=time.time,
                 links: Links | None = None):
        self.ledger = ledger
        self.links = links  # who paid and where payouts go link accounts (broker.links)
        self.repo = repo
        self.gateway = gateway
        self.credit_price_cents = credit_price_cents
        self.currency = currency
        self.public_url = public_url.rstrip("/")
        self.account_exists = account_exists
        self.clock = clock

    @property
    def funding_mode(self) -> str:
        """``"stripe"`` with Stripe keys, ``"dev"`` (admin grants) without."""
        return "dev" if self.gateway is None else "stripe"

    @property
    def how_to_fund(self) -> str:
        if self.gateway is None:
            return ("this broker runs in dev funding mode: ask an admin to grant credits "
                    "(`sparecycles broker grant --account ACCOUNT_ID --credits N`)")
        return "buy credits with POST /v1/credits/checkout"

    def _gateway(self) -> PaymentGateway:
        if self.gateway is None:
            raise FundingNotConfigured("this broker runs in dev funding mode (no Stripe keys "
                                       "configured): an admin grants credits with `sparecycles "
                                       "broker grant`; set SPARECYCLES_STRIPE_SECRET_KEY to sell them")
        return self.gateway

    def _deposit(self, account_id: str, amount_micro: int, *, key: str, source: FundingSource,
                 memo: str) -> Transaction:
        for opened in (False, True):
            try:
                return self.ledger.deposit(account_id, amount_micro, idempotency_key=key,
                                           source=source, memo=memo)
            except lerr.UnknownAccount:
                if opened or not self.account_exists(account_id):
                    raise NotFound(f"no account {account_id!r}; account ids are printed by "
                                   "`sparecycles broker create-key`") from None
                self.ledger.open_client(account_id)
        raise AssertionError("unreachable")

    # ---- dev funding --------------------------------------------------------------------
    def grant(self, account_id: str, amount_micro: int, *, by: str,
              idempotency_key: str | None = None) -> Transaction:
        """Credit a client account from the platform's dev grants (dev funding mode only)."""
        if self.gateway is not None:
            raise NotDevFunding("grants are only allowed in dev funding mode; this broker sells "
                                "credits through Stripe (POST /v1/credits/checkout)")
        if not isinstance(account_id, str) or not account_id:
            raise InvalidPaymentAmount("account_id is required", field="account_id")
        return self._deposit(account_id, amount_micro, source=FundingSource.DEV_GRANT,
                             key=f"grant:{idempotency_key or uuid.uuid4().hex}",
                             memo=f"dev grant by {by}")

    # ---- checkout ---------------------------------------------------------------------
    def checkout(self, account_id: str, credits: object, *, idempotency_key: str | None = None) -> dict:
        gateway = self._gateway()
        if type(credits) is not int or not 1 <= credits <= MAX_CREDITS_PER_CHECKOUT:
            raise InvalidPaymentAmount(f"credits is {credits!r}; buy a whole number of credits "
                                       f"from 1 to {MAX_CREDITS_PER_CHECKOUT:,}", field="credits")
        amount_cents = credits * self.credit_price_cents
        try:
            session = gateway.create_checkout(
                account_id=account_id, credits=credits, amount_cents=amount_cents,
                currency=self.currency,
                success_url=f"{self.public_url}/v1/account?checkout=success",
                cancel_url=f"{self.public_url}/v1/account?checkout=cancelled",
                idempotency_key=f"checkout-{account_id}-{idempotency_key or uuid.uuid4().hex}")
        except GatewayError as exc:
            raise PaymentProviderError(f"Stripe refused the checkout session: {exc}; nothing was "
                                       "charged, try again") from None
        return {"id": session.id, "url": session.url, "credits": credits,
                "amount_cents": amount_cents, "currency": self.currency}

    # ---- webhook ----------------------------------------------------------------------
    def handle_webhook(self, payload: bytes, signature_header: str | None) -> dict:
        """Verify and apply one Stripe event; returns what was done. Safe to repeat."""
        gateway = self._gateway()
        try:
            event = gateway.parse_event(payload, signature_header)
        except SignatureError as exc:
            raise WebhookRefused(f"webhook signature refused: {exc}") from None
        if event.type in PAID_EVENTS:
            return {"event": event.id, **self._checkout_paid(event.object.get("id", ""))}
        if event.type == "transfer.reversed":
            return {"event": event.id, **self._transfer_reversed(event.object.get("id", ""))}
        return {"event": event.id, "result": "ignored"}

    def _checkout_paid(self, session_id: str) -> dict:
        try:
            session = self._gateway().retrieve_checkout(session_id)  # never trust the copy
        except GatewayError as exc:
            # 5xx: Stripe retries the event later; nothing was written.
            raise PaymentProviderError(f"could not re-fetch checkout session {session_id}: {exc}") from None
        if session.payment_status not in ("paid", "no_payment_required"):
            return {"result": "not_paid_yet", "session": session.id}
        account_id = str(session.metadata.get("sparecycles_account", ""))
        try:
            credits = int(session.metadata.get("credits", ""))
        except ValueError:
            credits = 0
        if (not account_id or credits <= 0 or session.currency != self.currency
                or session.amount_total != credits * self.credit_price_cents):
            log.error("checkout session %s does not match a Sparecycles purchase (metadata %s, "
                      "%s %s); not credited", session.id, session.metadata, session.amount_total,
                      session.currency)
            return {"result": "not_ours", "session": session.id}
        txn = self._deposit(account_id, credits * MICRO_PER_CREDIT, key=f"stripe:{session.id}",
                            source=FundingSource.PAYMENT, memo=f"stripe checkout {session.id}")
        if self.links is not None and session.customer:
            self.links.record(account_id, "stripe_customer", session.customer,
                              f"stripe customer {session.customer[:8]}…")
        return {"result": "credited", "session": session.id, "transaction": txn.id}

    # ---- payouts ----------------------------------------------------------------------
    def onboarding_link(self, owner_id: str) -> dict:
        gateway = self._gateway()
        try:
            acct = self.repo.connect_account(owner_id)
            if acct is None:
                acct = gateway.create_connect_account(owner_id)
                self.repo.set_connect_account(owner_id, acct, self.clock())
            if self.links is not None:
                self.links.record(owner_id, "payout_account", acct, f"payout account {acct[:8]}…")
            url = gateway.onboarding_link(acct, refresh_url=f"{self.public_url}/v1/payouts/onboarding",
                                          return_url=f"{self.public_url}/v1/account")
        except GatewayError as exc:
            raise PaymentProviderError(f"Stripe Connect refused onboarding: {exc}") from None
        return {"account": acct, "url": url}

    def payout(self, owner_id: str, amount_micro: int, *, idempotency_key: str | None = None) -> Payout:
        """Pay ``amount_micro`` of the provider's available credits to its Connect account."""
        gateway = self._gateway()
        destination = self.repo.connect_account(owner_id)
        if destination is None:
            raise PayoutAccountMissing("no payout account yet: onboard with POST "
                                       "/v1/payouts/onboarding, then retry")
        micro_per_cent = MICRO_PER_CREDIT // self.credit_price_cents
        if type(amount_micro) is not int or amount_micro <= 0 or amount_micro % micro_per_cent:
            raise InvalidPaymentAmount(
                f"amount_micro is {amount_micro!r}; pay out a positive whole number of cents "
                f"(a multiple of {micro_per_cent:,} micro-credits)", field="amount_micro")
        amount_cents = amount_micro // micro_per_cent
        txn = self.ledger.payout(AccountId(AccountKind.PROVIDER_AVAILABLE, owner_id), amount_micro,
                                 idempotency_key=f"payout:{owner_id}:{idempotency_key or uuid.uuid4().hex}",
                                 memo=f"Stripe Connect transfer to {destination}")
        existing = self.repo.get_payout(txn.id)
        if existing is not None and existing.status != "pending":
            return existing  # a retried request
        payout = Payout(id=txn.id, owner_id=owner_id, amount_micro=amount_micro,
                        amount_cents=amount_cents, currency=self.currency,
                        destination=destination, status="pending", created_at=self.clock())
        self.repo.add_payout(payout)
        try:
            transfer_id = gateway.create_transfer(
                amount_cents=amount_cents, currency=self.currency, destination=destination,
                idempotency_key=f"payout-{txn.id}",
                metadata={"sparecycles_payout": txn.id, "sparecycles_account": owner_id})
        except GatewayError as exc:
            reversal = self._reverse_payout(payout, f"transfer failed: {exc}")
            raise PaymentProviderError(
                f"Stripe refused the transfer: {exc}; the payout was reversed (transaction "
                f"{reversal.id}) and the credits are available again", payout=txn.id) from None
        self.repo.update_payout(txn.id, status="paid", transfer_id=transfer_id)
        return self.repo.get_payout(txn.id)  # type: ignore[return-value]

    def _reverse_payout(self, payout: Payout, reason: str) -> Transaction:
        reversal = self.ledger.reverse(payout.id, idempotency_key=f"payout:{payout.id}:reverse",
                                       reason=reason)
        self.repo.update_payout(payout.id, status="failed", error=reason,
                                reversal_transaction_id=reversal.id)
        return reversal

    def _transfer_reversed(self, transfer_id: str) -> dict:
        payout = self.repo.payout_by_transfer(transfer_id)
        if payout is None:
            return {"result": "ignored", "transfer": transfer_id}
        if payout.status == "failed":
            return {"result": "already_reversed", "payout": payout.id}
        reversal = self._reverse_payout(payout, f"Stripe reversed transfer {transfer_id}")
        return {"result": "payout_reversed", "payout": payout.id, "transaction": reversal.id}

    def payouts(self, owner_id: str) -> list[Payout]:
        return self.repo.payouts_of(owner_id)

    def paid_out_micro(self, owner_id: str) -> int:
        return self.repo.paid_out_micro(owner_id)


def payout_to_json(p: Payout) -> dict:
    return {"id": p.id, "object": "payout", "amount_micro": p.amount_micro,
            "amount_cents": p.amount_cents, "currency": p.currency, "status": p.status,
            "destination": p.destination, "transfer_id": p.transfer_id,
            "reversal_transaction_id": p.reversal_transaction_id, "error": p.error,
            "created_at": p.created_at}
