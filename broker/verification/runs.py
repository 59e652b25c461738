"""Which settled jobs are checked, and the runs that check them: the draw (sampling), the
check or third run queued as an ordinary job with the pinned inputs and its operators
excluded, and the hold that pays for a platform-sampled run.

A part of :class:`broker.verification.service.VerificationService`.
"""
from __future__ import annotations

import logging
import uuid
from typing import Any

from broker.billing.errors import InsufficientCredits
from broker.jobs.model import Job
from broker.jobs.service import SEED_INPUT
from broker.ledger import errors as lerr
from broker.ledger.model import AccountId, AccountKind, FundingSource
from broker.verification.judging import SCORE_INPUT
from broker.verification.outcomes import Role
from broker.verification.records import CheckStatus, Verification
from broker.verification.sampling import SamplingPolicy, Standing, decide_check

log = logging.getLogger(__name__)

#: The client account that platform-sampled check jobs belong to (and are held against).
CHECK_ACCOUNT = "platform-checks"


class VerificationRuns:
    """Sampling and queueing check runs (a part of VerificationService)."""

    # ---- sampling -------------------------------------------------------------------
    def _decide(self, job: Job, receipt: dict) -> None:
        if self.repo.get(job.id) is not None:
            return  # decided already (a re-sent receipt)
        hw = self._repro(job).hardware_class
        owner = self.providers.owner_of(job.provider_id) or ""
        balances = self.ledger.balances(owner) if owner else {}
        standing = self.repo.standing(job.provider_id, job.plugin, hw)
        gain, value = self._hold_figures(job)
        policy = self.policies.policy(job.plugin)
        # S in the economic floor is what a caught cheat really loses: the slashed part of
        # its stake, and its unvested credits only where those are clawed back.
        penalty = self.settings.penalty
        decision = decide_check(
            Standing(standing.consecutive_valid,
                     int(max(0, balances.get(AccountKind.PROVIDER_STAKE, 0))
                         * penalty.slash_fraction),
                     max(0, balances.get(AccountKind.PROVIDER_VESTING, 0))
                     if penalty.claw_back_unvested else 0),
            self.rng, gain_micro=gain, job_value_micro=value,
            catch_probability=self.settings.catch_probability.get(job.plugin),
            policy=SamplingPolicy(self.settings.new_provider_checks,
                                  policy.always_verify_above_micro or None))
        check = decision.check or job.verify == "always"
        reason = "client_asked" if job.verify == "always" else decision.reason.value
        if check and self._unseeded(job):
            # Queued before the broker fixed every job's seed: a check could only re-run it
            # with the seed its provider reports, which proves nothing.
            check, reason = False, "unseeded"
        v, created = self.repo.add(Verification(
            job_id=job.id, plugin=job.plugin, provider_id=job.provider_id or "",
            hardware_class=hw, status=CheckStatus.CHECKING if check else CheckStatus.UNCHECKED,
            p=1.0 if job.verify == "always" else decision.p, reason=reason,
            draw=decision.draw, created_at=self.clock()))
        if not created:
            return  # another thread or replica drew for this job first: its entry stands
        self._audit("verification.sampled", job.id,
                    {"provider": job.provider_id, "hardware_class": hw, "check": check,
                     "p": decision.p, "reason": reason, "draw": round(decision.draw, 6),
                     "economic_floor": decision.economic_floor,
                     "cv": standing.consecutive_valid, "gain_micro": gain,
                     "receipt": job.receipt})
        if check:
            self._spawn(v, job, Role.CHECKER, {owner}, client_pays=job.verify == "always")
        self._event(job.id, v.status, "a second provider will re-run this job" if check
                    else "not sampled for a check")

    def _unseeded(self, job: Job) -> bool:
        """Whether the job's plugin takes a seed the broker did not fix (a job from
        before it drew one for every job)."""
        try:
            names = self.catalog.get(job.plugin, job.plugin_version).inputs.names
        except Exception:  # noqa: BLE001 - a retired version: judged on what it has
            return False
        return SEED_INPUT in names and (job.inputs or {}).get(SEED_INPUT) is None

    def _hold_figures(self, job: Job) -> tuple[int, int]:
        """(g, value): the provider's share of the job, and what the client paid."""
        if job.hold_id is None:
            return 0, 0
        try:
            hold = self.ledger.get_hold(job.hold_id)
        except Exception:  # noqa: BLE001 - an unsettled hold: judge by the cap
            return job.max_price_micro, job.max_price_micro
        return hold.provider_micro, hold.captured_micro

    def _spawn(self, v: Verification, primary: Job, role: Role, exclude_operators: set[str],
               client_pays: bool, inputs: dict[str, Any] | None = None,
               delay_s: float | None = None) -> Job | None:
        """Queue a check (or tiebreak) run of ``primary`` on another operator's provider:
        a re-run of its pinned inputs after a random delay, unless ``inputs`` and
        ``delay_s`` say otherwise (a scoring run)."""
        # The operators ("operator:<id>", which the dispatcher matches against each
        # session's account, so every machine of theirs is excluded, one they connect later
        # too) and the machine that ran the job.
        operators = set(exclude_operators) - {""}
        if self.links is not None:  # and every account linked to one of them
            for o in list(operators):
                operators |= self.links.linked_to(o)
        excluded = sorted(({primary.provider_id or ""}
                           | {f"operator:{o}" for o in operators}) - {"", "operator:"})
        delay = self.rng.uniform(*self.settings.check_delay_s) if delay_s is None else delay_s
        check_id = str(uuid.uuid4())  # fresh and unlinkable to the job it checks
        column = "checker_job_id" if role is Role.CHECKER else "tiebreak_job_id"
        expect = CheckStatus.CHECKING if role is Role.CHECKER else CheckStatus.DISPUTED
        try:
            # The run (its funding, hold and row) and the record naming it commit together:
            # a failure in between leaves neither, so a retry never queues a second run.
            with self.jobs.atomic():
                account, check = self._submit_run(primary, check_id, excluded, delay,
                                                  client_pays,
                                                  inputs or pinned_inputs(primary))
                if self.repo.update(v.job_id, {expect}, **{column: check.id}) is None:
                    raise _RecordMoved
                self._audit(f"verification.{role.value}_queued", v.job_id,
                            {"check_job": check.id, "excluded_providers": excluded,
                             "paid_by": account, "delay_s": round(delay, 3),
                             "scoring": _is_scoring(check)})
        except _RecordMoved:  # judged, given up or queued by another thread meanwhile
            return None
        return check

    def _submit_run(self, primary: Job, check_id: str, excluded: list[str], delay: float,
                    client_pays: bool, inputs: dict[str, Any]) -> tuple[str, Job]:
        """(who pays, the run) for :meth:`_spawn`: the client when it asked for every job to
        be checked and can pay, else the platform."""
        if client_pays:
            try:
                return primary.account_id, self.jobs.submit_check(
                    primary, check_id, primary.account_id, inputs, excluded,
                    not_before=self.clock() + delay)
            except InsufficientCredits as exc:  # the client's balance ran short (nothing held)
                log.warning("job %s: the client's check could not be held (%s); the "
                            "platform pays for it", primary.id, exc)
        with self._fund_lock:  # fund the shortfall, then hold: one at a time
            return CHECK_ACCOUNT, self.jobs.submit_check(
                primary, check_id, CHECK_ACCOUNT, inputs, excluded,
                not_before=self.clock() + delay, fund=self._fund)

    def _fund(self, check_id: str, amount_micro: int) -> None:
        """The platform pays for a check it sampled: credit the checks account with what
        it lacks for the check's hold (what earlier checks left unspent is used first)."""
        try:
            have = self.ledger.balance(AccountId(AccountKind.CLIENT_AVAILABLE, CHECK_ACCOUNT))
        except lerr.UnknownAccount:  # no account yet: it holds nothing (other errors raise)
            have = 0
        short = amount_micro - max(0, have)
        if short > 0:
            self.ledger.deposit(CHECK_ACCOUNT, short,
                                idempotency_key=f"check:{check_id}:fund",
                                source=FundingSource.VERIFICATION,
                                memo=f"check run {check_id}")


class _RecordMoved(Exception):
    """The verification record moved before the run queued for it was recorded."""


def _rerun_of(check: Job) -> dict[str, Any]:
    """How a failed check is queued again: the same inputs when it was a scoring run (the
    primary's claimed tokens), at once; else a re-run like the first (``_spawn``'s
    defaults, with a fresh delay)."""
    if _is_scoring(check):
        return {"inputs": dict(check.inputs), "delay_s": 0.0}
    return {}


def _third_run_of(checker: Job) -> dict[str, Any]:
    """How a dispute's third run is queued: a scoring run of the same claimed tokens when
    the check was one (its verdict is then compared score for score with the check's, and
    each against the claim), else a re-run like the check (``_spawn``'s defaults)."""
    if _is_scoring(checker):
        return {"inputs": dict(checker.inputs), "delay_s": 0.0}
    return {}


def _is_scoring(job: Job) -> bool:
    """Whether ``job`` is a scoring run: decided by what the broker asked of it (its
    inputs), never by what its provider reports."""
    return SCORE_INPUT in (job.inputs or {})


def pinned_inputs(job: Job) -> dict[str, Any]:
    """The job's inputs as the broker holds them: what a re-run of it is given. They carry
    the job's seed, which the broker fixed at submit (``broker.jobs.service.draw_seed``),
    never the seed a provider's meta reports: a provider that returned an image made with
    another seed (a cached one, for a job whose client gave none) cannot steer its check
    to that seed."""
    return dict(job.inputs)
