"""/v1/account (balances), /v1/account/transactions, /v1/quotes; and the funding-mode header
on every response (``X-Sparecycles-Funding: dev`` when credits are granted, not sold)."""
from __future__ import annotations

from flask import Blueprint

from broker.ledger.model import AccountId, AccountKind
from .common import int_arg, json_object, principal, services
from .job_request import QUOTE_FIELDS, job_request

bp = Blueprint("account", __name__)

FUNDING_HEADER = "X-Sparecycles-Funding"


@bp.after_app_request
def funding_header(response):
    response.headers[FUNDING_HEADER] = services().payments.funding_mode
    return response


def _kinds(role: str) -> dict[str, AccountKind]:
    if role == "provider":
        return {"available": AccountKind.PROVIDER_AVAILABLE, "vesting": AccountKind.PROVIDER_VESTING,
                "stake": AccountKind.PROVIDER_STAKE}
    if role == "publisher":
        return {"available": AccountKind.PUBLISHER_ROYALTIES}
    return {"available": AccountKind.CLIENT_AVAILABLE, "held": AccountKind.CLIENT_HELD}


@bp.get("/v1/account")
def get_account():
    who = principal()
    svc = services()
    balances = svc.ledger.balances(who.account_id)
    body = {"object": "account", "id": who.account_id, "role": who.role,
            "funding": svc.payments.funding_mode, "currency_unit": "micro-credit",
            "available_micro": 0, "held_micro": 0, "vesting_micro": 0, "stake_micro": 0,
            "paid_out_micro": 0}
    for name, kind in _kinds(who.role).items():
        body[f"{name}_micro"] = balances.get(kind, 0)
    if who.role in ("provider", "publisher"):
        body["paid_out_micro"] = svc.payments.paid_out_micro(who.account_id)
    if svc.payments.funding_mode == "dev":
        body["notice"] = ("dev funding mode: credits are granted by an admin, not bought "
                          "(no Stripe keys configured)")
    return body


@bp.get("/v1/account/transactions")
def list_transactions():
    who = principal()
    limit = int_arg("limit", 100, 1, 1000)
    ledger = services().ledger
    owned = ledger.balances(who.account_id)
    lines = []
    for name, kind in _kinds(who.role).items():
        if kind not in owned:
            continue
        for line in ledger.history(AccountId(kind, who.account_id), limit=limit):
            lines.append({"transaction_id": line.transaction_id, "kind": line.kind.value,
                          "account": name, "amount_micro": line.amount_micro,
                          "created_at": line.created_at.isoformat(), "memo": line.memo,
                          "hold_id": line.hold_id})
    lines.sort(key=lambda x: x["created_at"], reverse=True)
    return {"object": "list", "data": lines[:limit]}


@bp.post("/v1/quotes")
def create_quote():
    svc = services()
    asked = job_request(json_object(QUOTE_FIELDS, '{"plugin": "sd15", "inputs": {...}}'),
                        svc.catalog, QUOTE_FIELDS)
    manifest = asked.manifest
    # as a job would run them: the weights' own defaults (image sizes) for what is left out
    inputs = svc.jobs.resolve_inputs(manifest, asked.inputs)
    q = svc.pricing.quote(manifest.name, manifest.version, manifest.work_units_for(inputs))
    # Adapter royalties (issue #5) are added to the hold at submit and paid after the
    # provider's share and before the platform fee (broker/billing/service.py).
    royalties = svc.registry.royalty_breakdown(manifest.name, inputs)
    royalty = royalties.micro
    return {"object": "quote", "plugin": q.plugin, "version": q.version,
            "work_units": q.work_units, "min_micro": q.min_micro + royalty,
            "expected_micro": q.expected_micro + royalty,
            "max_micro": q.max_micro + royalty,
            "held_at_submit_micro": q.max_micro + royalty,
            "royalty_micro": royalty,
            "royalties": [{"adapter": r.adapter, "version": r.version,
                           "publisher_account": r.publisher_account,
                           "royalty_micro": r.royalty_micro,
                           "charged": royalties.charged(r)}
                          for r in royalties.royalties],
            "price": {"reserve_micro_per_unit": q.price.reserve_micro_per_unit,
                      "fee_bps": q.price.fee_bps, "min_charge_micro": q.price.min_charge_micro}}
