"""Money in and out over REST: Stripe Checkout, the Stripe webhook, Connect payouts, and the
admin's prices and dev grants."""
from __future__ import annotations

from flask import Blueprint, request

from broker.errors import Forbidden, InvalidRequest
from broker.payments.service import credits_to_micro, payout_to_json
from broker.pricing.service import price_to_json
from .common import json_body, principal, services

bp = Blueprint("credits", __name__)

WEBHOOK_PATH = "/v1/stripe/webhook"  # public: Stripe signs it instead of a bearer key


def _require(*roles: str):
    who = principal()
    if who.role not in roles:
        raise Forbidden(f"this needs a {' or '.join(roles)} key; yours is a {who.role} key")
    return who


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


@bp.post("/v1/credits/checkout")
def create_checkout():
    who = _require("client", "admin")
    body = _object(json_body())
    return services().payments.checkout(who.account_id, body.get("credits"),
                                        idempotency_key=request.headers.get("Idempotency-Key")), 201


@bp.post(WEBHOOK_PATH)
def stripe_webhook():
    # The signature covers the exact bytes Stripe sent: read them raw, never re-serialise.
    result = services().payments.handle_webhook(request.get_data(cache=False),
                                                request.headers.get("Stripe-Signature"))
    return {"received": True, **result}


@bp.post("/v1/payouts/onboarding")
def payout_onboarding():
    who = _require("provider")
    return services().payments.onboarding_link(who.account_id), 201


@bp.post("/v1/payouts")
def create_payout():
    who = _require("provider")
    body = _object(json_body())
    if ("credits" in body) == ("amount_micro" in body):
        raise InvalidRequest('send either "credits" or "amount_micro"')
    amount = (credits_to_micro(body["credits"]) if "credits" in body else body["amount_micro"])
    payout = services().payments.payout(who.account_id, amount,
                                        idempotency_key=request.headers.get("Idempotency-Key"))
    return payout_to_json(payout), 201


@bp.get("/v1/payouts")
def list_payouts():
    who = _require("provider")
    return {"object": "list", "data": [payout_to_json(p) for p in
                                       services().payments.payouts(who.account_id)]}


# ---- admin ------------------------------------------------------------------------------
@bp.get("/v1/admin/prices")
def list_prices():
    _require("admin")
    svc = services()
    return {"object": "list", "data": [price_to_json(p) for p in
                                       svc.pricing.prices(svc.catalog.names())]}


@bp.get("/v1/admin/prices/<plugin>")
def get_price(plugin):
    _require("admin")
    return price_to_json(services().pricing.price(plugin))


@bp.put("/v1/admin/prices/<plugin>")
def set_price(plugin):
    who = _require("admin")
    svc = services()
    svc.catalog.get(plugin)  # 404 for a plugin the broker does not know
    return price_to_json(svc.pricing.set_price(plugin, _object(json_body()), by=who.account_id))


@bp.post("/v1/admin/grants")
def grant_credits():
    who = _require("admin")
    body = _object(json_body())
    account = body.get("account_id")
    if not isinstance(account, str) or not account:
        raise InvalidRequest("account_id is required", field="account_id")
    amount_micro = credits_to_micro(body.get("credits"))
    txn = services().payments.grant(account, amount_micro, by=who.account_id,
                                    idempotency_key=request.headers.get("Idempotency-Key"))
    return {"object": "grant", "account_id": account, "transaction_id": txn.id,
            "amount_micro": amount_micro}, 201
