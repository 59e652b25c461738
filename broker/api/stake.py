"""/v1/account/stake and /v1/account/unstake: a provider puts some of its available
credits at stake (DESIGN §6), or takes them back. Verification slashes part of the stake
of a provider outvoted by the other runs; admins set a minimum stake per plugin below
which a provider gets none of that plugin's jobs.

Stake comes from the provider's *available* credits: earnings that have vested (a job's
share vests once the price's vesting window, a week by default, has passed since it
settled; until then a failed check can still take it back). So a new provider has nothing
to stake until its first earnings vest; the refusal says so, with what it has vesting and
when the next part vests, in the terms of GET /v1/account (never a ledger account)."""
from __future__ import annotations

import uuid

from flask import Blueprint

from broker.errors import BrokerError, Conflict, InvalidRequest
from broker.ledger import errors as lerr
from broker.ledger.model import AccountKind, format_credits
from .common import idempotency_key, json_object, one_request_per_key, require_role, services

bp = Blueprint("stake", __name__)


class NotEnoughToStake(BrokerError):
    code, http_status, grpc_status, title = ("insufficient_credits", 402, "FAILED_PRECONDITION",
                                             "Not enough credits")


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
    key = idempotency_key(120) or str(uuid.uuid4())
    svc = services()
    ledger, verification = svc.ledger, svc.verification
    if operation == "unstake" and verification is not None:
        machines = [p.id for p in svc.providers.all() if p.account_id == who.account_id]
        open_checks = verification.repo.open_for(machines)
        if open_checks:
            raise Conflict(f"{open_checks} of your jobs are being checked; the stake backs "
                           "them until their checks end: unstake after that")
    try:
        # One ledger key for both routes: a key names one request, so the same key on
        # stake and then on unstake (or with another amount) is refused, not run twice.
        with one_request_per_key(key):
            getattr(ledger, operation)(who.account_id, amount,
                                       idempotency_key=f"stake:{who.account_id}:{key}")
    except lerr.InsufficientCredits as exc:
        raise _short(operation, who.account_id, amount, exc.available_micro) from None
    if verification is not None:
        verification.stake_changed(who.account_id)  # dispatch sees the new stake at once
    balances = ledger.balances(who.account_id)
    return {"object": "stake", "stake_micro": balances.get(AccountKind.PROVIDER_STAKE, 0),
            "available_micro": balances.get(AccountKind.PROVIDER_AVAILABLE, 0)}


def _short(operation: str, account_id: str, amount: int, have: int) -> NotEnoughToStake:
    """Why ``amount`` cannot be staked (or unstaked), in GET /v1/account's terms."""
    want = format_credits(amount)
    if operation == "unstake":
        return NotEnoughToStake(f"you asked to unstake {want} but have {format_credits(have)} "
                                "at stake; unstake at most that", field="amount_micro",
                                stake_micro=have)
    ledger = services().ledger
    vesting = ledger.balances(account_id).get(AccountKind.PROVIDER_VESTING, 0)
    pending = sorted((h for h in ledger.unvested_holds(account_id) if h.vests_at is not None),
                     key=lambda h: h.vests_at)
    if pending:
        first = pending[0].vests_at
        due = sum(h.provider_micro for h in pending if h.vests_at == first)
        later = (f"{format_credits(vesting)} vesting, of which {format_credits(due)} vests "
                 f"on {first.strftime('%Y-%m-%d %H:%M UTC')}")
    else:
        later = ("nothing vesting yet: what you earn by running jobs vests once the "
                 "plugin's vesting window, a week by default, has passed since the job settled")
    return NotEnoughToStake(
        f"staking takes credits from your available (vested) balance: you asked to stake "
        f"{want} and have {format_credits(have)} available ({later}). Stake at most what is "
        "available, or wait until your earnings vest (GET /v1/account shows both)",
        field="amount_micro", available_micro=have, vesting_micro=vesting)


@bp.post("/v1/account/stake")
def stake():
    return _move("stake")


@bp.post("/v1/account/unstake")
def unstake():
    return _move("unstake")
