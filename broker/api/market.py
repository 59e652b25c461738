"""/v1/asks: standing asks and the broker's throughput figures. Sealed: a provider sees its
own machines' asks, an admin sees all; everyone else gets 403. /v1/admin/market: the
market's rules (the reputation floor), read and set by admins."""
from __future__ import annotations

from flask import Blueprint, request

from broker.errors import Forbidden, InvalidRequest
from .common import json_object, principal, require_role, services

bp = Blueprint("market", __name__)


@bp.get("/v1/asks")
def list_asks():
    who = principal()
    svc = services()
    if who.role == "admin":
        wanted = request.args.get("provider_id")
        rows = svc.market.asks({wanted} if wanted else None)
    elif who.role == "provider":
        rows = [r for r in svc.market.asks()
                if svc.providers.owner_of(r["provider_id"]) == who.account_id]
    else:
        raise Forbidden("asks are sealed: only their provider and admins may read them")
    return {"object": "list", "data": rows}


@bp.get("/v1/admin/market")
def get_market_rules():
    require_role("admin", what="reading the market's rules")
    return {"object": "market_rules", **services().market.market_rules()}


@bp.put("/v1/admin/market")
def set_market_rules():
    who = require_role("admin", what="setting the market's rules")
    svc = services()
    body = json_object(("reputation_floor",), '{"reputation_floor": 0.5}')
    if "reputation_floor" not in body:
        raise InvalidRequest('send {"reputation_floor": 0.5}: reputation_floor is the only '
                             "rule set here", field="reputation_floor")
    svc.market.set_reputation_floor(body["reputation_floor"], by=who.account_id)  # audited
    return {"object": "market_rules", **svc.market.market_rules()}
