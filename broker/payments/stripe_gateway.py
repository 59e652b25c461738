"""The :class:`PaymentGateway` on the ``stripe`` library's :class:`stripe.StripeClient`.

The API base address is a setting (``SPARECYCLES_STRIPE_API_BASE``), so tests run the real
library against a local HTTP stub of the few endpoints used; nothing here patches stripe.
"""
from __future__ import annotations

import stripe

from broker.payments.model import CheckoutSession, WebhookEvent
from broker.payments.ports import GatewayError, SignatureError


def _session(obj) -> CheckoutSession:
    s = obj.to_dict()
    return CheckoutSession(id=s["id"], url=s.get("url"), payment_status=s.get("payment_status") or "",
                           amount_total=s.get("amount_total"), currency=s.get("currency"),
                           metadata=dict(s.get("metadata") or {}),
                           customer=s.get("customer") if isinstance(s.get("customer"), str)
                           else None)


class StripeGateway:
    def __init__(self, secret_key: str, webhook_secret: str | None, *, api_base: str | None = None,
                 webhook_tolerance_s: int = 300, max_network_retries: int = 2):
        addresses = {"api": api_base.rstrip("/")} if api_base else None
        self.client = stripe.StripeClient(secret_key, base_addresses=addresses,
                                          max_network_retries=max_network_retries)
        self.webhook_secret = webhook_secret
        self.webhook_tolerance_s = webhook_tolerance_s

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except stripe.StripeError as exc:
            raise GatewayError(exc.user_message or str(exc) or type(exc).__name__) from exc

    def create_checkout(self, *, account_id, credits, amount_cents, currency, success_url,
                        cancel_url, idempotency_key) -> CheckoutSession:
        params = {
            "mode": "payment",
            "client_reference_id": account_id,
            "success_url": success_url,
            "cancel_url": cancel_url,
            "line_items": [{"quantity": 1, "price_data": {
                "currency": currency, "unit_amount": amount_cents,
                "product_data": {"name": f"{credits:,} Sparecycles credits"}}}],
            "metadata": {"sparecycles_account": account_id, "credits": str(credits)},
        }
        s = self._call(self.client.v1.checkout.sessions.create, params,
                       {"idempotency_key": idempotency_key})
        return _session(s)

    def retrieve_checkout(self, session_id: str) -> CheckoutSession:
        return _session(self._call(self.client.v1.checkout.sessions.retrieve, session_id))

    def create_connect_account(self, owner_id: str) -> str:
        acct = self._call(self.client.v1.accounts.create,
                          {"type": "express", "metadata": {"sparecycles_account": owner_id}},
                          {"idempotency_key": f"connect-{owner_id}"})
        return acct["id"]

    def onboarding_link(self, stripe_account_id, *, refresh_url, return_url) -> str:
        link = self._call(self.client.v1.account_links.create,
                          {"account": stripe_account_id, "refresh_url": refresh_url,
                           "return_url": return_url, "type": "account_onboarding"})
        return link["url"]

    def create_transfer(self, *, amount_cents, currency, destination, idempotency_key,
                        metadata) -> str:
        transfer = self._call(self.client.v1.transfers.create,
                              {"amount": amount_cents, "currency": currency,
                               "destination": destination, "metadata": metadata},
                              {"idempotency_key": idempotency_key})
        return transfer["id"]

    def parse_event(self, payload: bytes, signature_header: str | None) -> WebhookEvent:
        try:
            event = stripe.Webhook.construct_event(payload, signature_header, self.webhook_secret,
                                                   tolerance=self.webhook_tolerance_s)
        except stripe.SignatureVerificationError as exc:
            raise SignatureError(str(exc).split(".")[0]) from None
        except ValueError as exc:
            raise SignatureError(f"the body is not a Stripe event: {exc}") from None
        return WebhookEvent(id=event["id"], type=event["type"],
                            object=event["data"]["object"].to_dict())
