"""JobBilling: what the job lifecycle does with money (DESIGN §2, §5).

* submit: a hold for the job's maximum price (reserve × work units, at least the minimum
  charge), keyed ``job:<id>:hold`` so that a resubmit with the same job id gets the same hold.
* settlement: the hold is posted: the provider's price (rate × work units used, at least
  the minimum charge, at most the hold) less the platform's fee into the provider's vesting
  balance, the fee to the platform, the rest back to the client.
* royalties (issue #5): a settled job that used published adapters with a royalty also
  pays each adapter's publisher its royalties (PUBLISHER_ROYALTIES, one leg per publisher),
  in the same post and within the same hold. The hold is divided in this order: (1) the
  provider's share (charge − fee), never cut; (2) the royalties, publisher by publisher in
  the order the job names their adapters, up to what the hold has left; (3) the platform
  fee, up to what is left after that; (4) the rest released to the client. So the client
  never pays more than its hold, the provider is never cut, and when the hold is tight (a
  cold market charges the reserve, i.e. the whole hold) the platform's fee gives way to
  the publishers. ``royalty_of(plugin, inputs, as_of) -> ((publisher, micro), ...)`` is
  injected (broker.registry.RegistryService.royalty_split). Cancelled jobs pay no royalty.
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
from broker.billing.shared import (cancel_shared, open_accounts_and, royalty_fields,
                                   settle_shared)
from broker.jobs.checkpoints import Part
from broker.jobs.model import Job
from broker.ledger import errors as lerr
from broker.ledger.model import AccountId, AccountKind, Splits, Transaction
from broker.ledger.service import LedgerService
from broker.pricing.model import exact_units
from broker.pricing.service import PricingService

log = logging.getLogger(__name__)

DEFAULT_HOLD_TTL_S = 24 * 3600


class JobBilling:
    def __init__(self, ledger: LedgerService, pricing: PricingService,
                 provider_owner: Callable[[str], str | None], *,
                 hold_ttl_s: int = DEFAULT_HOLD_TTL_S,
                 how_to_fund: str = "buy credits at /v1/credits/checkout",
                 royalty_of: Callable[[str, dict, float | None], tuple[tuple[str, int], ...]]
                 | None = None):
        self.ledger = ledger
        self.pricing = pricing
        self.provider_owner = provider_owner  # provider (machine) id -> provider account id
        self.hold_ttl_s = hold_ttl_s
        self.how_to_fund = how_to_fund
        # (plugin, job inputs, job created_at) -> ((adapter publisher, royalty micro), ...);
        # versions published after the job was submitted do not count, so a retried post
        # always asks for the same royalties.
        self.royalty_of = royalty_of or (lambda plugin, inputs, as_of: ())

    # ---- submit -------------------------------------------------------------------
    def hold(self, job_id: str, client: str, plugin: str, work_units: float,
             cap_micro: int | None = None, inputs: dict | None = None) -> tuple[str, int]:
        """Hold the job's maximum price plus the royalties of the adapters its ``inputs``
        name (at most the client's ``cap_micro``); returns (hold id, amount). Raises
        :class:`InsufficientCredits` (402) and writes nothing when the balance is short."""
        amount = self.max_price(plugin, work_units, inputs=inputs)
        if cap_micro is not None:
            amount = min(amount, cap_micro)
        return self.hold_amount(job_id, client, amount), amount

    def hold_amount(self, job_id: str, client: str, amount: int) -> str:
        """Hold exactly ``amount`` (a job's maximum price, a result-cache hit's price);
        returns the hold id. The same errors as :meth:`hold`."""
        for opened in (False, True):
            try:
                return self.ledger.hold(client, amount, job_id,
                                        idempotency_key=f"job:{job_id}:hold",
                                        ttl_s=self.hold_ttl_s).id
            except lerr.UnknownAccount:
                if opened:
                    raise
                self.ledger.open_client(client)
            except lerr.InsufficientCredits as exc:
                raise InsufficientCredits(needed_micro=amount, available_micro=exc.available_micro,
                                          how_to_fund=self.how_to_fund) from None
        raise AssertionError("unreachable")

    def settle_cached(self, job: Job, amount: int, price) -> Transaction | None:
        """Post a result-cache hit's hold: the fee to the platform, the rest to the provider
        of the verified run it was answered from (``job.provider_id``, broker.jobs.cache)."""
        return self._post(job, amount, price.fee_of(amount), price.vesting_window_s)

    def max_price(self, plugin: str, work_units: float, cap_micro: int | None = None,
                  inputs: dict | None = None) -> int:
        """What a hold for such a job reserves: the plugin's maximum price plus the royalty
        of the adapters ``inputs`` name (as published now), at most the cap."""
        amount = self.pricing.price(plugin).max_price_micro(work_units)
        if inputs:
            amount += sum(max(0, micro) for _, micro in self.royalty_of(plugin, inputs, None))
        return amount if cap_micro is None else min(amount, cap_micro)

    def require(self, client: str, plugin: str, work_units: float, *,
                cap_micro: int | None = None, runs: int = 1, inputs: dict | None = None) -> None:
        """Refuse (402, nothing written) unless the client can pay ``runs`` such jobs: a job
        with ``verify="always"`` is paid twice, once per run."""
        need = runs * self.max_price(plugin, work_units, cap_micro, inputs=inputs)
        have = self.available(client)
        if have < need:
            raise InsufficientCredits(needed_micro=need, available_micro=have,
                                      how_to_fund=self.how_to_fund)

    def available(self, client: str) -> int:
        """The client's available balance in micro-credits (0 before its first credit)."""
        try:
            return self.ledger.balance(AccountId(AccountKind.CLIENT_AVAILABLE, client))
        except lerr.UnknownAccount:
            return 0

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
        return self._post(job, *self._settlement(job, work_units_used))

    def settle_many(self, settled: list[tuple[Job, float | str]]) -> list[Transaction]:
        """:meth:`settle` of each ``(job, work units used)`` in one ledger call
        (``LedgerService.post_many``: the statements of one post for all of them, issue
        #28). All or nothing: when one of them is not a plain post (no hold, nothing to
        charge, a provider without an account) or the ledger refuses the batch, nothing is
        written and this raises; the caller then settles them one at a time, where each
        gets its own answer."""
        posts = []
        for job, units in settled:
            post = (self._post_of(job, *self._settlement(job, units))
                    if job.hold_id is not None and job.provider_id is not None else None)
            if post is None:
                raise lerr.PostsNotBatched(f"job {job.id} is not settled by a plain post")
            posts.append(post)
        return open_accounts_and(self.ledger, lambda: self.ledger.post_many(posts))

    def _settlement(self, job: Job, work_units_used: float | str) -> tuple[int, int, int, bool]:
        """What settling ``job`` posts: (charge, fee, vesting window, with royalties)."""
        # Work units as exact fractions, each parsed once (charge_micro takes a Fraction).
        try:
            units = exact_units(work_units_used)
        except (TypeError, ValueError, ZeroDivisionError):
            log.warning("job %s: receipt reports work units %r; charging the manifest's %s",
                        job.id, work_units_used, job.work_units)
            units = None
        price = self.pricing.price(job.plugin)
        # The manifest's formula bills the most a job can use: a receipt reporting more
        # work units than that is charged for the formula's (so an inflated report cannot
        # eat into the adapter royalty or the fee that the hold also carries).
        most = exact_units(job.work_units)
        if units is None or units > most:
            units = most
        charge = price.charge_micro(self.rate_of(job), units, cap_micro=job.max_price_micro)
        # A verification re-run is not a client's use of an adapter: no royalty on checks.
        return (charge, price.fee_of(charge), price.vesting_window_s,
                not getattr(job, "check_of", None))

    def cancelled(self, job: Job, reason: str, done: Fraction = Fraction(0)) -> Transaction | None:
        """``job`` as it was just before it was cancelled: pay ``done`` (the share of its
        work units the provider *showed* it did: checkpoints the broker holds, tokens it
        streamed; see ``JobService.shown_fraction``), release the rest. Progress a provider
        only reports is never paid: it costs nothing to claim."""
        if job.hold_id is None:
            return None
        done = min(Fraction(1), max(Fraction(0), Fraction(done)))
        if job.provider_id and done > 0:
            price = self.pricing.price(job.plugin)
            charge = price.charge_micro(self.rate_of(job), exact_units(job.work_units) * done,
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

    def royalty_within_hold(self, job: Job, provider_micro: int,
                            fee: int) -> tuple[list[tuple[str, int]], int]:
        """([(publisher, royalty), ...], fee) for a settled job: the royalties fit, one
        publisher after another, in what the hold has left after the providers' shares
        (``provider_micro``), the fee in what is left after them."""
        owed = [(p, m) for p, m in self.royalty_of(job.plugin, job.inputs or {},
                                                  getattr(job, "created_at", None)) if m > 0]
        if not owed:
            return [], fee
        # Every submit path (single, split batch, check) stores the held amount as the
        # job's max price (``hold`` returns it); a row from before that falls back to the hold.
        hold_amount = job.max_price_micro or self.ledger.get_hold(job.hold_id).amount_micro
        room = max(0, hold_amount - provider_micro)
        legs = []
        for publisher, micro in owed:
            micro = min(micro, room)
            if micro <= 0:
                break
            legs.append((publisher, micro))
            room -= micro
        return legs, min(fee, room)

    def _post(self, job: Job, charge: int, fee: int, vesting_window_s: int,
              royalty: bool = False) -> Transaction | None:
        post = self._post_of(job, charge, fee, vesting_window_s, royalty)
        if post is None:
            if charge <= 0:
                return self.release_hold(job.hold_id, job.id, "nothing to charge")
            log.error("job %s: provider %s has no account; releasing the hold", job.id,
                      job.provider_id)
            return self.release_hold(job.hold_id, job.id, "provider unknown")
        hold_id, splits, key, window_s = post
        return open_accounts_and(self.ledger, lambda: self.ledger.post(
            hold_id, splits, idempotency_key=key, vesting_window_s=window_s))

    def _post_of(self, job: Job, charge: int, fee: int, vesting_window_s: int,
                 royalty: bool = False) -> tuple[str, Splits, str, int] | None:
        """The ledger post (hold id, splits, idempotency key, vesting window) that charges
        ``charge`` with ``fee``; None when the hold is released instead (nothing to charge,
        or the provider has no account)."""
        if charge <= 0:
            return None
        owner = self.provider_owner(job.provider_id)
        if owner is None:
            return None
        provider_micro = charge - fee  # the provider's share comes first and is never cut
        legs: list[tuple[str, int]] = []
        if royalty:
            legs, fee = self.royalty_within_hold(job, provider_micro, fee)
        splits = Splits(provider=owner, provider_micro=provider_micro, fee_micro=fee,
                        **royalty_fields(legs))
        return job.hold_id, splits, f"job:{job.id}:post", vesting_window_s

    def settle_shared(self, job: Job, work_units_used, parts: list[Part],
                      resumed: Fraction) -> Transaction | None:
        """:meth:`settle` for a job resumed from checkpoints: each provider that worked on
        it is paid its share (broker.billing.shared)."""
        return settle_shared(self, job, work_units_used, parts, resumed)

    def cancel_shared(self, job: Job, parts: list[Part], resumed: Fraction, reason: str,
                      shown: Fraction = Fraction(0)) -> Transaction | None:
        """:meth:`cancelled` for a job resumed from checkpoints (broker.billing.shared)."""
        return cancel_shared(self, job, parts, resumed, reason, shown)
