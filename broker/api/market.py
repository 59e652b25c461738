"""/v1/asks: standing asks and the broker's throughput figures. Sealed: a provider sees its
own machines' asks, an admin sees all; everyone else gets 403. /v1/admin/market: the
market's rules (the reputation floor), read and set by admins."""
from __future__ import annotations

from flask import Blueprint, request

from broker.errors import Forbidden, InvalidRequest, NotFound
from .common import json_body, principal, services

bp = Blueprint("market", __name__)


@bp.get("/v1/asks")
def list_asks():
    who = principal()
    svc = services()
    if svc.market is None:
        return {"object": "list", "data": []}
    if who.role == "admin":
        wanted = request.args.get("provider_id")
        rows = svc.market.asks({wanted} if wanted else None)
    elif who.role == "provider":
        rows = [r for r in svc.market.asks()
                if svc.providers.owner_of(r["provider_id"]) == who.account_id]
    else:
        raise Forbidden("asks are sealed: only their provider and admins may read them")
    return {"object": "list", "data": rows}


def _admin():
    who = principal()
    if who.role != "admin":
        raise Forbidden(f"the market's rules are for admins; yours is a {who.role} key")
    return who


@bp.get("/v1/admin/market")
def get_market_rules():
    _admin()
    market = services().market
    if market is None:
        raise NotFound("this broker runs without a market")
    return {"object": "market_rules", **market.market_rules()}


@bp.put("/v1/admin/market")
def set_market_rules():
    who = _admin()
    svc = services()
    if svc.market is None:
        raise NotFound("this broker runs without a market")
    body = json_body()
    if not isinstance(body, dict) or set(body) - {"reputation_floor"} or not body:
        raise InvalidRequest('the body must be a JSON object like {"reputation_floor": 0.5}; '
                             "reputation_floor is the only rule set here")
    before = svc.market.market_rules()["reputation_floor"]
    after = svc.market.set_reputation_floor(body["reputation_floor"], by=who.account_id)
    if svc.audit is not None:
        svc.audit.record(f"admin:{who.account_id}", "market.set", "market:reputation_floor",
                         {"before": before, "after": after})
    return {"object": "market_rules", **svc.market.market_rules()}
