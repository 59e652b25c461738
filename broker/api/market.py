"""/v1/asks: standing asks and the broker's throughput figures. Sealed: a provider sees its
own machines' asks, an admin sees all; everyone else gets 403."""
from __future__ import annotations

from flask import Blueprint, request

from broker.errors import Forbidden
from .common import principal, services

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
