"""Settling a job that several providers worked on in turn (resumed from checkpoints).

The client pays once, within the job's single hold: the finishing provider is paid for the
share it did (rate × work units × (1 − resumed fraction)), each earlier provider for the
share its checkpoint added (see ``broker.jobs.checkpoints``), each share rounded down on
its own, and the platform takes its fee of each share; the job's adapter royalties are
paid once, with the finishing provider's share (none when cancelled). One ledger call
(``LedgerService.post_shared``) moves it all, keyed on the job, so a retry is harmless.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from fractions import Fraction
from typing import Callable

from broker.jobs.checkpoints import Part
from broker.jobs.model import Job
from broker.ledger import errors as lerr
from broker.ledger.model import AccountId, AccountKind, Splits, Transaction
from broker.ledger.service import LedgerService
from broker.pricing.model import exact_units

log = logging.getLogger(__name__)


def shares_micro(billing, job: Job, work_units_used, parts: list[Part],
                 resumed: Fraction) -> tuple[int, list[tuple[Part, int]]]:
    """(the finishing provider's charge, [(part, its charge)]), all within the hold."""
    price = billing.pricing.price(job.plugin)
    try:
        units = exact_units(work_units_used)
    except (TypeError, ValueError, ZeroDivisionError):
        units = exact_units(job.work_units)
    cap = job.max_price_micro
    earlier = []
    for part in parts:
        rate = part.rate_micro_per_unit if part.rate_micro_per_unit is not None \
            else billing.rate_of(job)
        charge = price.charge_micro(rate, units * part.fraction, cap_micro=cap, minimum=False)
        cap -= charge
        if charge > 0:
            earlier.append((part, charge))
    final = price.charge_micro(billing.rate_of(job), units * (1 - resumed), cap_micro=cap,
                               minimum=False)
    return final, earlier


def settle_shared(billing, job: Job, work_units_used, parts: list[Part],
                  resumed: Fraction) -> Transaction | None:
    if job.hold_id is None or job.provider_id is None:
        return None
    final, earlier = shares_micro(billing, job, work_units_used, parts, resumed)
    if final <= 0 or billing.provider_owner(job.provider_id) is None:
        log.error("job %s: cannot pay the finishing provider %s (share %d); settling "
                  "without parts", job.id, job.provider_id, final)
        return billing.settle(job, work_units_used)
    # A verification re-run is not a client's use of an adapter: no royalty on checks.
    return _post_shares(billing, job, [(job.provider_id, -1, final)]
                        + [(p.provider_id, p.attempt, c) for p, c in earlier],
                        royalty=not job.check_of)


def cancel_shared(billing, job: Job, parts: list[Part], resumed: Fraction,
                  reason: str, shown: Fraction = Fraction(0)) -> Transaction | None:
    """``job`` (as it was just before it was cancelled) resumed from a checkpoint: each
    earlier provider is paid its share, the current one what it showed since the resume
    (``shown``: the share of the whole job its checkpoints or streamed tokens reach, see
    ``JobService.shown_fraction``; no minimum charge); the rest goes back to the client."""
    if job.hold_id is None:
        return None
    done = Fraction(0)
    if job.provider_id:
        done = max(Fraction(0), min(Fraction(1), shown) - resumed)
    final, earlier = shares_micro(billing, job, job.work_units, parts, 1 - done)
    shares = ([(job.provider_id, -1, final)] if final > 0 else []) + \
        [(p.provider_id, p.attempt, c) for p, c in earlier]
    if not shares:
        return billing.release_hold(job.hold_id, job.id, reason or "job cancelled")
    return _post_shares(billing, job, shares)


def _post_shares(billing, job: Job, shares: list[tuple[str, int, int]], *,
                 royalty: bool = False) -> Transaction | None:
    """Post the hold for ``shares`` [(provider id, attempt, charge)]: the first on the hold
    itself, the others as parts (``LedgerService.post_shared``). With ``royalty``, the
    job's adapter royalties ride on the first, divided as a single post divides them:
    every provider's share first, then the royalties, then the first share's fee."""
    price = billing.pricing.price(job.plugin)
    splits = []
    for provider_id, attempt, charge in shares:
        owner = billing.provider_owner(provider_id)
        if owner is None:
            log.error("job %s: provider %s (attempt %d) has no account; its share stays "
                      "with the client", job.id, provider_id, attempt)
            continue
        splits.append(Splits(provider=owner, provider_micro=charge - price.fee_of(charge),
                             fee_micro=price.fee_of(charge)))
    if not splits:
        return billing.release_hold(job.hold_id, job.id, "no provider to pay")
    main, others = splits[0], splits[1:]
    if royalty:
        before = main.provider_micro + sum(sp.captured_micro for sp in others)
        legs, fee = billing.royalty_within_hold(job, before, main.fee_micro)
        if legs:
            main = replace(main, fee_micro=fee, **royalty_fields(legs))
    return open_accounts_and(billing.ledger, lambda: billing.ledger.post_shared(
        job.hold_id, main, others, idempotency_key=f"job:{job.id}:post",
        vesting_window_s=price.vesting_window_s))


def royalty_fields(legs: list[tuple[str, int]]) -> dict:
    """``Splits`` keyword arguments paying ``legs`` [(publisher, royalty), ...]."""
    if not legs:
        return {}
    return {"publisher": legs[0][0], "royalty_micro": legs[0][1],
            "other_royalties": tuple(legs[1:])}


def open_accounts_and(ledger: LedgerService, post: Callable[[], Transaction]) -> Transaction:
    """``post()``, opening each provider-vesting or publisher-royalties account it names
    that does not exist yet (a provider or publisher paid for the first time), once each."""
    opened: set[AccountId] = set()
    while True:
        try:
            return post()
        except lerr.UnknownAccount as exc:
            account = exc.account
            if account in opened or account.kind not in (AccountKind.PROVIDER_VESTING,
                                                         AccountKind.PUBLISHER_ROYALTIES):
                raise
            opened.add(account)
            if account.kind is AccountKind.PROVIDER_VESTING:
                ledger.open_provider(account.owner)
            else:
                ledger.open_publisher(account.owner)
