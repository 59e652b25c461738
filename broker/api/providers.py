"""/v1/providers: a provider operator's machines at a glance (issue #26): each machine's
connection, its availability as its agent last said (idle-only, schedule, limits), jobs
today, credits pending/vesting/available/paid and verification standing. What
`sparecycles agent status` shows. An admin reads any account's with ``?account_id=``."""
from __future__ import annotations

import time

from flask import Blueprint, request

from broker.errors import InvalidRequest
from broker.ledger.model import AccountKind
from broker.providers.overview import overview
from .common import require_role, services

bp = Blueprint("providers", __name__)


@bp.get("/v1/providers")
def list_machines():
    who = require_role("provider", "admin", what="reading provider machines")
    account_id = who.account_id
    if who.role == "admin":
        account_id = request.args.get("account_id", "")
        if not account_id:
            raise InvalidRequest("an admin names the provider account: "
                                 "/v1/providers?account_id=ACCOUNT_ID")
    svc = services()
    balances = svc.ledger.balances(account_id)
    verification = svc.verification
    return overview(
        account_id, svc.providers.machines_of(account_id), queries=svc.admin.queries,
        pricing=svc.pricing,
        standings=(verification.repo.standings if verification is not None
                   else (lambda _pid: [])),
        connected=lambda pid: svc.dispatcher.session(pid) is not None,
        balances={"vesting_micro": balances.get(AccountKind.PROVIDER_VESTING, 0),
                  "available_micro": balances.get(AccountKind.PROVIDER_AVAILABLE, 0),
                  "paid_out_micro": svc.payments.paid_out_micro(account_id)},
        now=time.time())
