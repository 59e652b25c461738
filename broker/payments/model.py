"""Values of payments."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Payout:
    """A transfer of a provider's available credits to its Stripe Connect account. ``id`` is
    the ledger's payout transaction id. ``status``: pending → paid | failed (the ledger
    payout is then reversed by ``reversal_transaction_id``)."""

    id: str
    owner_id: str
    amount_micro: int
    amount_cents: int
    currency: str
    destination: str
    status: str
    transfer_id: str | None = None
    reversal_transaction_id: str | None = None
    error: str | None = None
    created_at: float = 0.0


@dataclass(frozen=True)
class CheckoutSession:
    """The fields of a Stripe Checkout session that the broker uses."""

    id: str
    url: str | None
    payment_status: str          # paid | unpaid | no_payment_required
    amount_total: int | None     # in the currency's minor unit (cents)
    currency: str | None
    metadata: dict[str, Any]
    customer: str | None = None  # the Stripe customer that paid (links accounts, broker.links)


@dataclass(frozen=True)
class WebhookEvent:
    id: str
    type: str
    object: dict[str, Any]
