"""/v1/account/stake and /v1/account/unstake: a provider puts some of its available
credits at stake (DESIGN §6), or takes them back. Verification slashes part of the stake
of a provider outvoted by the other runs; admins set a minimum stake per plugin below
which a provider gets none of that plugin's jobs."""
from __future__ import annotations

import uuid

from flask import Blueprint, request

from broker.errors import Conflict, InvalidRequest
from broker.ledger.model import AccountKind
from .common import json_object, require_role, services

bp = Blueprint("stake", __name__)


def _amount() -> int:
    amount = json_object(("amount_micro",), '{"amount_micro": 1000000}').get("amount_micro")
    if type(amount) is not int or amount <= 0:
        raise InvalidRequest(f"amount_micro is {amount!r}; it must be a positive integer "
                             "number of micro-credits (1 credit = 1,000,000)",
                             field="amount_micro")
    return amount


def _move(operation: str):
    who = require_role("provider", what="staking (only provider accounts hold stake)")
    amount = _amount()
    key = request.headers.get("Idempotency-Key") or str(uuid.uuid4())
    svc = services()
    ledger, verification = svc.ledger, svc.verification
    if operation == "unstake" and verification is not None:
        machines = [p.id for p in svc.providers.all() if p.account_id == who.account_id]
        open_checks = verification.repo.open_for(machines)
        if open_checks:
            raise Conflict(f"{open_checks} of your jobs are being checked; the stake backs "
                           "them until their checks end: unstake after that")
    getattr(ledger, operation)(who.account_id, amount,
                               idempotency_key=f"{operation}:{who.account_id}:{key}")
    if verification is not None:
        verification.stake_changed(who.account_id)  # dispatch sees the new stake at once
    balances = ledger.balances(who.account_id)
    return {"object": "stake", "stake_micro": balances.get(AccountKind.PROVIDER_STAKE, 0),
            "available_micro": balances.get(AccountKind.PROVIDER_AVAILABLE, 0)}


@bp.post("/v1/account/stake")
def stake():
    return _move("stake")


@bp.post("/v1/account/unstake")
def unstake():
    return _move("unstake")
