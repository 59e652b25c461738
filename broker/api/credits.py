"""Money in and out over REST: Stripe Checkout, the Stripe webhook, Connect payouts, and the
admin's prices and dev grants."""
from __future__ import annotations

from flask import Blueprint, request

from broker.errors import InvalidRequest
from broker.payments.service import credits_to_micro, payout_to_json
from broker.pricing.service import price_to_json
from .common import (idempotency_key, json_body, json_object, one_request_per_key,
                     require_role, services)

bp = Blueprint("credits", __name__)

WEBHOOK_PATH = "/v1/stripe/webhook"  # public: Stripe signs it instead of a bearer key


@bp.post("/v1/credits/checkout")
def create_checkout():
    who = require_role("client", "admin")
    body = json_object(("credits",), '{"credits": 10}')
    return services().payments.checkout(who.account_id, body.get("credits"),
                                        idempotency_key=idempotency_key()), 201


@bp.post(WEBHOOK_PATH)
def stripe_webhook():
    # The signature covers the exact bytes Stripe sent: read them raw, never re-serialise.
    result = services().payments.handle_webhook(request.get_data(cache=False),
                                                request.headers.get("Stripe-Signature"))
    return {"received": True, **result}


@bp.post("/v1/payouts/onboarding")
def payout_onboarding():
    who = require_role("provider")
    return services().payments.onboarding_link(who.account_id), 201


@bp.post("/v1/payouts")
def create_payout():
    who = require_role("provider")
    body = json_object(("credits", "amount_micro"), '{"credits": 10}')
    if ("credits" in body) == ("amount_micro" in body):
        raise InvalidRequest('send either "credits" or "amount_micro"')
    amount = (credits_to_micro(body["credits"]) if "credits" in body else body["amount_micro"])
    key = idempotency_key(150)
    with one_request_per_key(key):
        payout = services().payments.payout(who.account_id, amount, idempotency_key=key)
    return payout_to_json(payout), 201


@bp.get("/v1/payouts")
def list_payouts():
    who = require_role("provider")
    return {"object": "list", "data": [payout_to_json(p) for p in
                                       services().payments.payouts(who.account_id)]}


# ---- admin ------------------------------------------------------------------------------
@bp.get("/v1/admin/prices")
def list_prices():
    require_role("admin")
    svc = services()
    return {"object": "list", "data": [price_to_json(p) for p in
                                       svc.pricing.prices(svc.catalog.names())]}


@bp.get("/v1/admin/prices/<plugin>")
def get_price(plugin):
    require_role("admin")
    return price_to_json(services().pricing.price(plugin))


@bp.put("/v1/admin/prices/<plugin>")
def set_price(plugin):
    who = require_role("admin")
    svc = services()
    svc.catalog.get(plugin)  # 404 for a plugin the broker does not know
    # set_price refuses anything but an object of its fields, and names them.
    return price_to_json(svc.pricing.set_price(plugin, json_body(), by=who.account_id))


@bp.post("/v1/admin/grants")
def grant_credits():
    who = require_role("admin")
    body = json_object(("account_id", "credits"), '{"account_id": "<account id>", "credits": 10}')
    account = body.get("account_id")
    if not isinstance(account, str) or not account:
        raise InvalidRequest("account_id is required", field="account_id")
    amount_micro = credits_to_micro(body.get("credits"))
    key = idempotency_key(150)
    with one_request_per_key(key):
        txn = services().payments.grant(account, amount_micro, by=who.account_id,
                                        idempotency_key=key)
    return {"object": "grant", "account_id": account, "transaction_id": txn.id,
            "amount_micro": amount_micro}, 201
