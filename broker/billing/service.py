"""JobBilling: what the job lifecycle does with money (DESIGN §2, §5).

* submit: a hold for the job's maximum price (reserve × work units, at least the minimum
  charge), keyed ``job:<id>:hold`` so that a resubmit with the same job id gets the same hold.
* settlement: the hold is posted: the provider's price (rate × work units used, at least
  the minimum charge, at most the hold) less the platform's fee into the provider's vesting
  balance, the fee to the platform, the rest back to the client.
* cancel: a job cancelled mid-run pays the provider for the work units it reported done
  (no minimum charge, at most the hold); otherwise, and on failure or expiry, the hold is voided.

The rate is the job's clearing price from the auction (DESIGN §4), stored on the job when
it is assigned; a job assigned without one (no market wired) pays the reserve.
Every ledger call carries a key derived from the job id, so retrying any step is harmless.
"""
from __future__ import annotations

import logging
from fractions import Fraction
from typing import Callable

from broker.billing.errors import InsufficientCredits
from broker.jobs.model import Job
from broker.ledger import errors as lerr
from broker.ledger.model import AccountKind, Splits, Transaction
from broker.ledger.service import LedgerService
from broker.pricing.model import exact_units
from broker.pricing.service import PricingService

log = logging.getLogger(__name__)

DEFAULT_HOLD_TTL_S = 24 * 3600


class JobBilling:
    def __init__(self, ledger: LedgerService, pricing: PricingService,
                 provider_owner: Callable[[str], str | None], *,
                 hold_ttl_s: int = DEFAULT_HOLD_TTL_S,
                 how_to_fund: str = "buy credits at /v1/credits/checkout"):
        self.ledger = ledger
        self.pricing = pricing
        self.provider_owner = provider_owner  # provider (machine) id -> provider account id
        self.hold_ttl_s = hold_ttl_s
        self.how_to_fund = how_to_fund

    # ---- submit -------------------------------------------------------------------
    def hold(self, job_id: str, client: str, plugin: str, work_units: float,
             cap_micro: int | None = None) -> tuple[str, int]:
        """Hold the job's maximum price (at most the client's ``cap_micro``); returns (hold
        id, amount). Raises :class:`InsufficientCredits` (402) and writes nothing when the
        balance is short."""
        amount = self.pricing.price(plugin).max_price_micro(work_units)
        if cap_micro is not None:
            amount = min(amount, cap_micro)
        for opened in (False, True):
            try:
                hold = self.ledger.hold(client, amount, job_id, idempotency_key=f"job:{job_id}:hold",
                                        ttl_s=self.hold_ttl_s)
                return hold.id, amount
            except lerr.UnknownAccount:
                if opened:
                    raise
                self.ledger.open_client(client)  # an account from before the ledger existed
            except lerr.InsufficientCredits as exc:
                raise InsufficientCredits(needed_micro=amount, available_micro=exc.available_micro,
                                          how_to_fund=self.how_to_fund) from None
        raise AssertionError("unreachable")

    def release_hold(self, hold_id: str, job_id: str, reason: str) -> Transaction | None:
        """Void a hold; nothing when it is already resolved."""
        try:
            return self.ledger.void(hold_id, idempotency_key=f"job:{job_id}:void", reason=reason)
        except lerr.HoldAlreadyResolved:
            return None

    # ---- outcomes -----------------------------------------------------------------
    def settle(self, job: Job, work_units_used: float | str) -> Transaction | None:
        """Post the hold of a settled job for the work units its (signed) receipt reports,
        a decimal string; never more than the hold."""
        if job.hold_id is None or job.provider_id is None:
            return None
        try:
            exact_units(work_units_used)
        except (TypeError, ValueError, ZeroDivisionError):
            log.warning("job %s: receipt reports work units %r; charging the manifest's %s",
                        job.id, work_units_used, job.work_units)
            work_units_used = job.work_units
        price = self.pricing.price(job.plugin)
        charge = price.charge_micro(self.rate_of(job), work_units_used,
                                    cap_micro=job.max_price_micro)
        return self._post(job, charge, price.fee_of(charge), price.vesting_window_s)

    def cancelled(self, job: Job, reason: str) -> Transaction | None:
        """``job`` as it was just before it was cancelled: pay the work units done, release
        the rest."""
        if job.hold_id is None:
            return None
        done = self.units_done(job)
        if job.provider_id and done > 0:
            price = self.pricing.price(job.plugin)
            charge = price.charge_micro(self.rate_of(job), done,
                                        cap_micro=job.max_price_micro, minimum=False)
            if charge > 0:
                return self._post(job, charge, price.fee_of(charge), price.vesting_window_s)
        return self.release_hold(job.hold_id, job.id, reason or "job cancelled")

    def failed(self, job: Job, reason: str) -> Transaction | None:
        if job.hold_id is None:
            return None
        return self.release_hold(job.hold_id, job.id, reason or "job failed")

    def rate_of(self, job: Job) -> int:
        """Micro-credits per work unit: the auction's clearing price, else the reserve."""
        price = getattr(job, "price_micro_per_unit", None)
        if price is not None:
            return price
        return self.pricing.price(job.plugin).reserve_micro_per_unit

    @staticmethod
    def units_done(job: Job) -> Fraction:
        """Work units reported done: the job's units × progress step / total."""
        if job.progress_total <= 0 or job.progress_step <= 0:
            return Fraction(0)
        step = min(job.progress_step, job.progress_total)
        return exact_units(job.work_units) * step / job.progress_total

    def _post(self, job: Job, charge: int, fee: int, vesting_window_s: int) -> Transaction | None:
        if charge <= 0:
            return self.release_hold(job.hold_id, job.id, "nothing to charge")
        owner = self.provider_owner(job.provider_id)
        if owner is None:
            log.error("job %s: provider %s has no account; releasing the hold", job.id,
                      job.provider_id)
            return self.release_hold(job.hold_id, job.id, "provider unknown")
        splits = Splits(provider=owner, provider_micro=charge - fee, fee_micro=fee)
        for opened in (False, True):
            try:
                return self.ledger.post(job.hold_id, splits, idempotency_key=f"job:{job.id}:post",
                                        vesting_window_s=vesting_window_s)
            except lerr.UnknownAccount as exc:
                if opened or exc.account.kind is not AccountKind.PROVIDER_VESTING:
                    raise
                self.ledger.open_provider(owner)
        raise AssertionError("unreachable")
