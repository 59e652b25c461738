"""VerificationService: spot redundancy wired into the job lifecycle (DESIGN §6).

After a provider's signed receipt settles a job (its credits go to *vesting*, so they can
still be taken back), the service draws whether to check it (``sampling``). A check is an
ordinary job with a fresh random id, the same plugin version, the same pinned inputs (the
seed the broker fixed at submit), the same deadline and a price cap, queued after a random
delay with every machine of the first provider's operator excluded, so that on the wire it
is just another job. When the check's receipt settles, the two runs are judged
(``judging``); agreement raises both providers' CV; disagreement queues a third run on a
third operator and the 2-of-3 majority (``outcomes``) decides: the loser's job credits are
refunded to whoever paid for that run, part of its stake is slashed, its CV resets and its
concurrency quota drops; an overturned job gets the majority's outputs; three-way
disagreement refunds the client and slashes nobody. Every step is an audit-log entry with
the receipts and comparison figures, and a ``verification`` event on the client's job.

A text check whose run parts from the claimed completion (another numeric path, or a
claim its model would not have made) says nothing of the claimed tokens past that point,
so the service then asks a provider of another operator to score the claimed tokens by
teacher forcing (the plugin's ``score_tokens``) and judges that scoring as the check.

Checks the platform samples are paid by the platform (the ``platform_verification``
account funds a hold on the ``platform-checks`` client account, so the checker is paid and
vests like any provider); a client that asked ``verify="always"`` pays for its check.
"""
from __future__ import annotations

import json
import logging
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from sdk.protocol.canonical import canonical_bytes, sha256_hex

from broker.billing.errors import InsufficientCredits
from broker.cache import TtlCache
from broker.jobs.model import Job, JobOutput, JobState
from broker.jobs.repro import recorded_class
from broker.links.service import unlinked_pair
from broker.jobs.service import SEED_INPUT
from broker.ledger import errors as lerr
from broker.ledger.model import AccountId, AccountKind, FundingSource
from broker.verification.comparators import THRESHOLDS_PATH
from broker.verification.comparators import ReproClass, Verdict
from broker.verification.judging import (SCORE_INPUT, Judgement, Run, RunOutput,
                                         StoredJudgement, declared_repro, judge, needs_scoring,
                                         scoring_inputs)
from broker.verification.outcomes import (Outcome, Party, PenaltyPolicy, Role, Status,
                                          resolve_pair, resolve_three)
from broker.verification.records import (OPEN_STATUSES, CheckStatus, Verification,
                                         VerificationRepository)
from broker.verification.sampling import SamplingPolicy, Standing, decide_check

log = logging.getLogger(__name__)

#: The client account that platform-sampled check jobs belong to (and are held against).
CHECK_ACCOUNT = "platform-checks"


def load_catch_probabilities(path: Path | str = THRESHOLDS_PATH) -> dict[str, float]:
    """q per plugin, as ``bench/cheaters.py`` measured it (``thresholds.json``)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}
    return {k: float(v) for k, v in (data.get("catch_probability") or {}).get(
        "per_plugin", {}).items()}


@dataclass
class VerificationSettings:
    check_delay_s: tuple[float, float] = (0.0, 5.0)  # a check is queued after this random wait
    check_timeout_s: float = 3600.0  # a check no other operator ran by then is given up
    tiebreak_tries: int = 3          # third runs queued before a dispute waits for an admin
    check_tries: int = 4             # check runs queued (each failed one re-issued elsewhere)
    # A provider outvoted 2 to 1 with at least this many consecutive valid checks is not
    # slashed on that one dispute when no link explains it: a fresh third run decides.
    protect_cv: int = 20
    escalations: int = 2             # fresh third runs a dispute may get (links, long records)
    new_provider_checks: int = 10
    # Outvoted 2 to 1 on two clear mismatches: half the stake goes, and every credit not
    # vested yet goes back to its client. What a caught cheat loses is what the sampling's
    # economic floor counts as S (see _decide).
    penalty: PenaltyPolicy = field(default_factory=lambda: PenaltyPolicy(
        slash_fraction=0.5, claw_back_unvested=True))
    catch_probability: dict[str, float] = field(default_factory=load_catch_probabilities)


class Links(Protocol):
    """What verification needs of ``broker.links.LinkService``: which operator accounts
    the broker has seen tied to one another."""

    def linked_to(self, account_id: str) -> frozenset[str]: ...

    def linked(self, a: str, b: str) -> bool: ...

    def why(self, a: str, b: str) -> list[str]: ...


class _RecordMoved(Exception):
    """The verification record moved before the run queued for it was recorded."""


class VerificationService:
    def __init__(self, repo: VerificationRepository, jobs, catalog, ledger, providers,
                 policies, *, disputes=None, audit=None, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.time,
                 settings: VerificationSettings | None = None, links: Links | None = None):
        self.repo = repo
        self.links = links  # operators tied to one another: never each other's checkers
        self.jobs = jobs          # broker.jobs.service.JobService
        self.catalog = catalog
        self.ledger = ledger
        self.providers = providers
        self.policies = policies  # broker.pricing.policy.PolicyService
        self.disputes = disputes
        self.audit = audit
        self.rng = rng or random.SystemRandom()
        self.clock = clock
        self.settings = settings or VerificationSettings()
        self.on_quota = lambda provider_id, factor: None  # the dispatcher scales slots
        self._lock = threading.Lock()
        self._fund_lock = threading.Lock()
        self._stakes: TtlCache[str, int] = TtlCache(5.0)  # owner -> stake held
        self._judges: ThreadPoolExecutor | None = None  # see judge_in_background

    def judge_in_background(self) -> None:
        """Judge checks on a worker thread of their own from now on. Judging reads both
        runs' outputs and compares them (decoded images, scored texts): far longer than a
        settlement, and :meth:`settled` is called on the thread that settled the check,
        an agent's stream, whose heartbeats and receipts would wait behind it. One worker,
        as judgements take this service's lock one at a time anyway. A judgement the worker
        never made (the broker stopped first) is made by :meth:`sweep`."""
        if self._judges is None:
            self._judges = ThreadPoolExecutor(max_workers=1, thread_name_prefix="judge")

    def close(self) -> None:
        """Stop the judging worker; checks it had not judged yet wait for the sweep."""
        judges, self._judges = self._judges, None
        if judges is not None:
            judges.shutdown(wait=False, cancel_futures=True)

    # ---- hooks from the job service ----------------------------------------------------
    def settled(self, job: Job, receipt: dict) -> None:
        """A receipt settled ``job``: decide whether to check it (at once: before its
        client hears it settled), or judge it if it is a check (on the judging worker when
        there is one). Never raises (a settlement must stand whatever verification does)."""
        judges = self._judges
        if job.check_of and judges is not None:
            try:
                judges.submit(self._settled_now, job, receipt)
                return
            except RuntimeError:  # shut down meanwhile: judged here
                pass
        self._settled_now(job, receipt)

    def _settled_now(self, job: Job, receipt: dict) -> None:
        try:
            if job.check_of:
                self._check_settled(job)
            else:
                self._decide(job, receipt)
        except Exception:  # noqa: BLE001 - logged; the job's money and outputs stand
            log.exception("verification of job %s failed", job.id)

    def ended(self, job: Job) -> None:
        """A job failed or was cancelled: when it was a check, the check is given up."""
        if not job.check_of:
            return
        try:
            v = self.repo.by_check_job(job.id)
            if v is None:
                return
            if job.id == v.checker_job_id and v.status is CheckStatus.CHECKING:
                self._check_ended(v, job)
            elif job.id == v.tiebreak_job_id and v.status is CheckStatus.DISPUTED:
                self._tiebreak_ended(v, job)
            self._audit("verification.check_ended", v.job_id,
                        {"check_job": job.id, "state": job.state.value,
                         "error": job.error_code})
        except Exception:  # noqa: BLE001
            log.exception("verification: recording the end of check %s failed", job.id)

    def _check_ended(self, v: Verification, check: Job, why: str = "") -> None:
        """The check run failed or was given up (its provider failed it, even as
        "non-retryable"; nobody of another operator took it in time): it is re-issued as a
        fresh check, with the operator of every provider that failed it excluded as well as
        the primary's, up to ``check_tries`` runs in all. A check partner that fails the
        check so that the job stays unchecked only sends it to somebody else. Only when
        every try failed does the output stand unchecked (and the audit log says why)."""
        record = dict(v.outcome or {})
        tries = int(record.get("check_tries", 1))
        failed_by = sorted(set(record.get("check_failed_by") or [])
                           | ({self.providers.owner_of(check.provider_id) or ""}
                              if check.provider_id else set()) - {""})
        primary = self.jobs.repo.get(v.job_id)
        if primary is not None and tries < self.settings.check_tries:
            with self.jobs.repo.atomic():
                moved = self.repo.update(v.job_id, {CheckStatus.CHECKING},
                                         expect_checker=check.id,  # once per failed run
                                         outcome={**record, "check_tries": tries + 1,
                                                  "check_failed_by": failed_by})
                if moved is not None:
                    owner = self.providers.owner_of(primary.provider_id) or ""
                    again = self._spawn(moved, primary, Role.CHECKER,
                                        ({owner} | set(failed_by)) - {""},
                                        client_pays=primary.verify == "always",
                                        **_rerun_of(check))
                    if again is not None:
                        self._audit("verification.check_reissued", v.job_id,
                                    {"failed_check": check.id, "error": check.error_code,
                                     "state": check.state.value, "new_check": again.id,
                                     "try": tries + 1, "excluded_operators": failed_by,
                                     "why": why or "the check run did not settle"})
            return
        moved = self.repo.update(v.job_id, {CheckStatus.CHECKING}, expect_checker=check.id,
                                 status=CheckStatus.UNCHECKED,
                                 outcome={**record, "check_failed_by": failed_by,
                                          "note": f"no second provider could run the check "
                                                  f"({tries} tries, last: {check.error_code})"})
        if moved is not None:
            self._event(v.job_id, CheckStatus.UNCHECKED,
                        "the check could not run; the output stands unchecked")

    def _tiebreak_ended(self, v: Verification, tiebreak: Job) -> None:
        """The third run failed: queue another, twice at most; then the dispute waits for
        an admin (the runs disagree and no majority could be had)."""
        tries = int((v.outcome or {}).get("tiebreak_tries", 1))
        primary = self.jobs.repo.get(v.job_id)
        checker = self.jobs.repo.get(v.checker_job_id) if v.checker_job_id else None
        if primary is None or checker is None:
            return
        if tries < self.settings.tiebreak_tries:
            # The try is counted with the run it queues: a queueing that fails counts none
            # (the sweep finds the failed run again and retries).
            with self.jobs.repo.atomic():
                moved = self.repo.update(v.job_id, {CheckStatus.DISPUTED},
                                         expect_tiebreak=tiebreak.id,  # once per failed run
                                         outcome={**(v.outcome or {}),
                                                  "tiebreak_tries": tries + 1})
                if moved is not None:
                    self._spawn(moved, primary, Role.TIEBREAKER,
                                self._dispute_operators(moved, primary, checker, tiebreak),
                                client_pays=False, **_third_run_of(checker))
            return
        note = (f"no third provider could run the tiebreak ({tries} tries, last: "
                f"{tiebreak.error_code}); an admin decides")
        moved = self.repo.update(v.job_id, {CheckStatus.DISPUTED}, expect_tiebreak=tiebreak.id,
                                 outcome={**(v.outcome or {}), "note": note, "stalled": True})
        if moved is not None and self.disputes is not None:
            sides = self._sides({Role.PRIMARY: primary, Role.CHECKER: checker},
                                lambda job: "undecided")
            self.disputes.open(v.job_id, primary.plugin, sides, v.comparisons,
                               f"disputed: {note}")
            self._event(v.job_id, CheckStatus.DISPUTED, note)

    def sweep(self, *, settle_grace_s: float = 30.0, lookback_s: float = 86_400.0) -> int:
        """Finish what a stopped broker (or a failed step) left half done (run by the
        maintenance thread): sample settled jobs that have no draw yet, queue a check or
        third run that was drawn but never queued, judge checks whose run settled without
        a judgement, finish applying a judgement whose effects were not all applied (its
        record stays open until they are), and give up checks whose run failed or waited
        too long. Idempotent; returns how many records it moved."""
        now = self.clock()
        moved = 0
        for job in self.repo.undecided(now - lookback_s, now - settle_grace_s):
            if job.receipt is not None:
                self.settled(job, job.receipt)
                moved += 1
        # (runs in progress, or queued for less than the check timeout, are not listed)
        for v in self.repo.open_since(now - settle_grace_s,
                                      queued_before=now - self.settings.check_timeout_s):
            if (v.outcome or {}).get("stalled"):
                self.repo.touch(v.job_id)  # waits for an admin; let the others come first
                continue
            current = v.tiebreak_job_id if v.status is CheckStatus.DISPUTED else v.checker_job_id
            check = self.jobs.repo.get(current) if current else None
            if check is None:
                moved += self._queue_missing(v)
                continue
            if (check.state is JobState.QUEUED
                    and now - check.created_at > self.settings.check_timeout_s):
                # no provider of another operator took it in time: give the run up
                self.jobs.give_up(check, "check_timeout",
                                  f"no provider of another operator ran this within "
                                  f"{self.settings.check_timeout_s:g}s")
                moved += 1
            elif check.state is JobState.SETTLED:  # to judge, or its judgement to apply
                self._settled_now(check, check.receipt or {})
                if (self.repo.get(v.job_id) or v).status is v.status:
                    self.repo.touch(v.job_id)  # could not be judged now: not ahead of others
                moved += 1
            elif check.state.terminal:
                self.ended(check)
                moved += 1
            else:
                self.repo.touch(v.job_id)  # moved on since it was listed: look again later
        return moved

    def _queue_missing(self, v: Verification) -> int:
        """Queue the run an open record lacks: the check drawn but never queued, or the
        third run of a dispute whose queueing failed (the broker stopped, a hold or the
        dispatcher failed). Returns 1 when one was queued."""
        with self._lock:  # not alongside a judgement of this record queueing it too
            v = self.repo.get(v.job_id) or v
            current = (v.tiebreak_job_id if v.status is CheckStatus.DISPUTED
                       else v.checker_job_id)
            if current and self.jobs.repo.get(current) is not None:
                return 0  # queued meanwhile
            primary = self.jobs.repo.get(v.job_id)
            checker = (self.jobs.repo.get(v.checker_job_id)
                       if v.status is CheckStatus.DISPUTED and v.checker_job_id else None)
            try:
                if v.status is CheckStatus.CHECKING and primary is not None:
                    owner = self.providers.owner_of(primary.provider_id) or ""
                    self._spawn(v, primary, Role.CHECKER, {owner} - {""},
                                client_pays=primary.verify == "always")
                    return 1
                if (v.status is CheckStatus.DISPUTED and primary is not None
                        and checker is not None):
                    self._spawn(v, primary, Role.TIEBREAKER,
                                self._dispute_operators(v, primary, checker),
                                client_pays=False, **_third_run_of(checker))
                    return 1
            except Exception:  # noqa: BLE001 - logged; tried again after the others
                log.exception("verification of job %s: queueing its run failed", v.job_id)
            self.repo.touch(v.job_id)
            return 0

    # ---- admins ---------------------------------------------------------------------
    def admin_resolved(self, dispute) -> None:
        """An admin overrode a dispute (``DisputeService.on_resolved``): the chosen run's
        output stands. The client's job gets that run's outputs; a slash of that run's
        provider is reversed; a stalled dispute (no majority) also refunds the client when
        its job's run lost. Refunds already made stay made (the ledger corrects only by
        reversal, and a refund is final): the audit log says so."""
        with self._lock:  # not while a judgement's effects are being applied to the record
            self._admin_resolved(dispute)

    def _admin_resolved(self, dispute) -> None:
        v = self.repo.get(dispute.job_id)
        winner = (dispute.resolution or {}).get("winner_provider_id")
        primary = self.jobs.repo.get(dispute.job_id)
        if v is None or primary is None or not winner:
            return
        runs = [j for j in (primary,
                            self.jobs.repo.get(v.checker_job_id) if v.checker_job_id else None,
                            self.jobs.repo.get(v.tiebreak_job_id) if v.tiebreak_job_id else None)
                if j is not None and j.state is JobState.SETTLED]
        win = next((j for j in runs if j.provider_id == winner), None)
        if win is None:
            return
        record = dict(v.outcome or {})
        undone = []
        for pid, txn in (record.get("slash_transactions") or {}).items():
            if pid == winner:
                try:
                    self.ledger.reverse(txn, idempotency_key=f"dispute:{dispute.id}:unslash",
                                        reason=f"admin override of dispute {dispute.id}")
                    undone.append(txn)
                except Exception as exc:  # noqa: BLE001 - recorded for the admin
                    log.warning("dispute %s: reversing slash %s failed: %s", dispute.id, txn, exc)
        status = CheckStatus.VERIFIED if win.id == primary.id else CheckStatus.OVERTURNED
        if status is CheckStatus.OVERTURNED:
            self._refund(primary, f"admin override of dispute {dispute.id}")
        outs = ([JobOutput(primary.id, int(o["index"]), o["sha256"], o["media_type"],
                           int(o["size"])) for o in (primary.receipt or {}).get("outputs", [])]
                if win.id == primary.id else
                [JobOutput(primary.id, o.index, o.sha256, o.media_type, o.size)
                 for o in self.jobs.repo.outputs(win.id)])
        if [o.sha256 for o in outs] != [o.sha256 for o in self.jobs.repo.outputs(primary.id)]:
            self.jobs.repo.replace_outputs(primary.id, outs,
                                           ("admin_override", {"outputs_from": win.id}))
        record.update(status=status.value, stalled=False,
                      admin={"dispute": dispute.id, "winner": winner,
                             "reason": dispute.resolution.get("reason", ""),
                             "slashes_reversed": undone})
        self.repo.update(v.job_id, set(CheckStatus), status=status, outcome=record)
        self._audit("verification.admin_override", v.job_id,
                    {"dispute": dispute.id, "winner": winner, "status": status.value,
                     "slashes_reversed": undone})
        self._event(v.job_id, status, f"an admin decided: {dispute.resolution.get('reason', '')}")

    # ---- canaries -------------------------------------------------------------------
    def _canary_key(self, repro: ReproClass, plugin: str, version: str, inputs: dict) -> str:
        return sha256_hex(canonical_bytes({"plugin": plugin, "version": version,
                                           "inputs": inputs, "repro": repro.__dict__}))

    def _learn_from(self, source: str, plugin: str, version: str, inputs: dict) -> None:
        """The client job whose inputs a canary reused is its operator's answer for them,
        in its provider's class: recorded (once) before the canary is compared, so that a
        canary of another operator in that class makes the answer known."""
        job = self.jobs.repo.get(source)
        if job is None or not job.provider_id or not job.receipt \
                or job.state is not JobState.SETTLED:
            return
        key = self._canary_key(self._repro(job), plugin, version, inputs)
        self.repo.add_answer(key, _answer_of(job.receipt),
                             self.providers.owner_of(job.provider_id) or job.provider_id)

    def canary_answer(self, provider_id: str, plugin: str, version: str, inputs: dict,
                      receipt: dict, source: str = "", recorded: dict | None = None) -> str:
        """Compare a canary's outputs with the answer known for its inputs in its
        reproducibility class. An answer becomes known once providers of two operators
        not linked to each other (``broker.links``) returned it; a canary that disagrees with a known answer counts as a failed check
        (CV reset, quota cut; no money: canaries are unpaid), one that agrees as a valid
        check. ``source``: the client job whose inputs the canary reused (its answer
        counts for its own operator); ``recorded``: the class (and weights) its envelope
        recorded when it was sent (``Canary.repro``; None: what the machine declared
        last). Returns "learning", "valid", "invalid" or "ambiguous"."""
        repro = (self._declared(provider_id, plugin, version) if recorded is None else
                 declared_repro(provider_id, plugin, version, recorded,
                                str(recorded.get("weights_digest") or "")))
        key = self._canary_key(repro, plugin, version, inputs)
        answer = _answer_of(receipt)
        owner = self.providers.owner_of(provider_id) or provider_id
        if source:
            self._learn_from(source, plugin, version, inputs)
        linked = self.links.linked if self.links is not None else None
        known = [a for a, ops in self.repo.answers(key).items()  # two unlinked operators'
                 if unlinked_pair(ops, linked)]
        if not known:
            self.repo.add_answer(key, answer, owner)
            return "learning"
        if len(known) > 1:
            return "ambiguous"  # two answers each confirmed: this class is not reproducible
        valid = answer == known[0]
        standing = self.repo.record_check(
            provider_id, plugin, repro.hardware_class, valid=valid,
            quota_factor=None if valid else self.settings.penalty.quota_factor)
        if valid:
            self.repo.add_answer(key, answer, owner)
        else:
            self.on_quota(provider_id, self.repo.quota_factor(provider_id))
        if self.audit is not None:
            self.audit.record("verification", "verification.canary", f"provider:{provider_id}",
                              {"plugin": plugin, "valid": valid, "answer": answer,
                               "known": known[0], "cv": standing.consecutive_valid,
                               "receipt": receipt})
        return "valid" if valid else "invalid"

    # ---- reading ----------------------------------------------------------------------
    def status(self, job_id: str) -> Verification | None:
        return self.repo.get(job_id)

    def stake_ok(self, provider_id: str, plugin: str) -> bool:
        """Whether the provider holds the plugin's minimum stake (admin policy)."""
        need = self.policies.policy(plugin).min_stake_micro
        if need <= 0:
            return True
        owner = self.providers.owner_of(provider_id)
        return owner is not None and self._stake(owner) >= need

    def stake_changed(self, owner: str) -> None:
        self._stakes.invalidate(owner)

    def _stake(self, owner: str) -> int:
        return self._stakes.get(
            owner, lambda o: self.ledger.balances(o).get(AccountKind.PROVIDER_STAKE, 0))

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
            with self.jobs.repo.atomic():
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

    # ---- judging --------------------------------------------------------------------
    def _check_settled(self, check: Job) -> None:
        with self._lock:  # one judgement at a time per broker (the updates are conditional)
            v = self.repo.by_check_job(check.id)
            if v is None:
                log.warning("check job %s has no verification record", check.id)
                return
            if (v.outcome or {}).get("applied") is False:
                self._apply(v)  # judged already; its effects were not all applied
                return
            primary = self.jobs.repo.get(v.job_id)
            kind = self._output_kind(primary)
            # Each run's outputs are read once, before judging and outside it: a read that
            # fails is the broker's trouble, not a provider's wrong answer, so it raises
            # (the record stays open and the sweep judges it later).
            if check.id == v.checker_job_id and v.status is CheckStatus.CHECKING:
                tie = self._link_between(primary, check)
                if tie:  # linked after it was queued: its word is not another operator's
                    self._check_ended(v, check, why=f"the checker is linked to the primary's "
                                                    f"operator ({', '.join(tie)})")
                    return
                cmp = _judge(kind, self._load(primary), self._load(check))
                scoring = self._scoring_inputs(kind, primary, check, cmp)
                if scoring is not None:
                    self._score_instead(v, primary, check, cmp, scoring)
                    return
                outcome = resolve_pair(self._party(primary, Role.PRIMARY),
                                       self._party(check, Role.CHECKER), cmp)
                self._audit("verification.compared", primary.id,
                            {"check_job": check.id, "figures": outcome.comparisons,
                             "receipts": {"primary": primary.receipt,
                                          "checker": check.receipt}})
                if outcome.needs_tiebreak:
                    moved = self.repo.update(v.job_id, {CheckStatus.CHECKING},
                                             status=CheckStatus.DISPUTED,
                                             comparisons=outcome.comparisons,
                                             outcome={"note": outcome.note})
                    if moved is not None:
                        self._event(primary.id, CheckStatus.DISPUTED, outcome.note)
                        # should this fail, the sweep queues the third run
                        self._spawn(moved, primary, Role.TIEBREAKER,
                                    self._dispute_operators(moved, primary, check),
                                    client_pays=False, **_third_run_of(check))
                    return
                self._finish(v, outcome, {Role.PRIMARY: primary, Role.CHECKER: check},
                             CheckStatus.CHECKING)
            elif check.id == v.tiebreak_job_id and v.status is CheckStatus.DISPUTED:
                checker = self.jobs.repo.get(v.checker_job_id)
                runs = {role: self._load(job) for role, job in
                        ((Role.PRIMARY, primary), (Role.CHECKER, checker),
                         (Role.TIEBREAKER, check))}
                parties = {Role.PRIMARY: self._party(primary, Role.PRIMARY),
                           Role.CHECKER: self._party(checker, Role.CHECKER),
                           Role.TIEBREAKER: self._party(check, Role.TIEBREAKER)}
                outcome = resolve_three(
                    parties[Role.PRIMARY], parties[Role.CHECKER], parties[Role.TIEBREAKER],
                    primary_checker=StoredJudgement.of(v.comparisons["primary~checker"]),
                    primary_tiebreaker=_judge(kind, runs[Role.PRIMARY], runs[Role.TIEBREAKER]),
                    checker_tiebreaker=_judge(kind, runs[Role.CHECKER], runs[Role.TIEBREAKER]),
                    policy=self.settings.penalty)
                why, linked = self._escalation(v, outcome, parties, primary.plugin,
                                               {p.provider_id: j for p, j in (
                                                   (parties[Role.PRIMARY], primary),
                                                   (parties[Role.CHECKER], checker),
                                                   (parties[Role.TIEBREAKER], check))})
                if why and self._escalate(v, primary, checker, check, outcome, why, linked):
                    return
                self._finish(v, outcome, {Role.PRIMARY: primary, Role.CHECKER: checker,
                                          Role.TIEBREAKER: check}, CheckStatus.DISPUTED)

    # ---- whose word counts (issue #20) ------------------------------------------------
    def _link_between(self, a: Job, b: Job) -> list[str]:
        """What ties the operators of runs ``a`` and ``b`` (empty: nothing the broker saw)."""
        if self.links is None:
            return []
        oa = self.providers.owner_of(a.provider_id) or ""
        ob = self.providers.owner_of(b.provider_id) or ""
        if not self.links.linked(oa, ob):
            return []
        return self.links.why(oa, ob) or ["linked"]

    def _escalation(self, v: Verification, outcome: Outcome, parties: dict[Role, Party],
                    plugin: str, jobs: dict[str, Job]) -> tuple[str, bool]:
        """(why the 2-of-3 verdict must not penalise its loser yet, whether a link is the
        reason); ("", False) when it may. Never on the word of a provider linked to the
        accused, nor of two providers linked to each other; and, when no link explains
        it, not a slash on one dispute of a provider with a long honest record."""
        if not outcome.penalties:
            return "", False
        penalty = outcome.penalties[0]
        loser = next(p for p in parties.values() if p.provider_id == penalty.provider_id)
        winners = [p for p in parties.values() if p.provider_id != penalty.provider_id]
        if self.links is not None:
            pairs = [(winners[0], winners[1]), (winners[0], loser), (winners[1], loser)]
            for a, b in pairs:
                if self.links.linked(a.operator_id, b.operator_id):
                    ties = self.links.why(a.operator_id, b.operator_id) or ["linked"]
                    return (f"the {a.role.value} and the {b.role.value} are linked "
                            f"({', '.join(ties)})"), True
        slashes = penalty.slash_micro > 0 or penalty.claw_back_micro > 0
        if slashes and int((v.outcome or {}).get("escalations", 0)) == 0:
            job = jobs[loser.provider_id]
            standing = self.repo.standing(loser.provider_id, plugin,
                                          self._repro(job).hardware_class)
            if standing.consecutive_valid >= self.settings.protect_cv:
                return (f"the {loser.role.value} has {standing.consecutive_valid} consecutive "
                        "valid checks: one dispute does not slash it"), False
        return "", False

    def _escalate(self, v: Verification, primary: Job, checker: Job, tiebreak: Job,
                  outcome: Outcome, why: str, linked: bool) -> bool:
        """Put the verdict to a fresh third run (on an operator linked to none of the runs
        so far) instead of applying it; its tiebreaker's vote is dropped. True when the
        record was escalated or, with its escalations spent on links, stalled for an admin;
        False when the verdict may stand after all (a long record already escalated)."""
        record = dict(v.outcome or {})
        n = int(record.get("escalations", 0))
        if n >= self.settings.escalations:
            if not linked:
                return False
            note = (f"no verdict without the word of linked providers ({why}) after {n} "
                    "fresh third runs; an admin decides")
            moved = self.repo.update(v.job_id, {CheckStatus.DISPUTED},
                                     expect_tiebreak=tiebreak.id,
                                     comparisons=outcome.comparisons,
                                     outcome={**record, "note": note, "stalled": True})
            if moved is not None:
                if self.disputes is not None:
                    sides = self._sides({Role.PRIMARY: primary, Role.CHECKER: checker,
                                         Role.TIEBREAKER: tiebreak}, lambda job: "undecided")
                    self.disputes.open(v.job_id, primary.plugin, sides, outcome.comparisons,
                                       f"disputed: {note}")
                self._audit("verification.stalled", v.job_id, {"why": why, "note": note})
                self._event(v.job_id, CheckStatus.DISPUTED, note)
            return True
        dropped = sorted(set(record.get("dropped_operators") or [])
                         | {self.providers.owner_of(tiebreak.provider_id) or ""} - {""})
        with self.jobs.repo.atomic():
            moved = self.repo.update(v.job_id, {CheckStatus.DISPUTED},
                                     expect_tiebreak=tiebreak.id,
                                     outcome={**record, "escalations": n + 1,
                                              "dropped_operators": dropped,
                                              "dropped_tiebreaks": [
                                                  *(record.get("dropped_tiebreaks") or []),
                                                  tiebreak.id]})
            if moved is None:
                return True  # escalated or judged by another thread meanwhile
            again = self._spawn(moved, primary, Role.TIEBREAKER,
                                self._dispute_operators(moved, primary, checker),
                                client_pays=False, **_third_run_of(checker))
        self._audit("verification.escalated", v.job_id,
                    {"why": why, "dropped_tiebreak": tiebreak.id,
                     "new_tiebreak": again.id if again is not None else None,
                     "escalation": n + 1, "figures": outcome.comparisons})
        self._event(v.job_id, CheckStatus.DISPUTED, f"{why}: another provider decides")
        return True

    def _dispute_operators(self, v: Verification, primary: Job, checker: Job | None,
                           *more: Job) -> set[str]:
        """The operators a dispute's third run must not go to: the primary's, the
        checker's, those of third runs dropped or failed before (and, in _spawn, every
        account linked to one of them)."""
        ops = {self.providers.owner_of(j.provider_id) or ""
               for j in (primary, checker, *more) if j is not None and j.provider_id}
        return (ops | set((v.outcome or {}).get("dropped_operators") or [])) - {""}

    def _scoring_inputs(self, kind: str, primary: Job, check: Job,
                        cmp: Judgement) -> dict[str, Any] | None:
        """The inputs of a scoring run of the primary's claimed tokens, when the check's
        own run cannot judge them all: a text job whose runs parted (or whose check ended
        sooner), past that point the checker's context is not the claim's and its run
        says nothing of the claimed tokens. None when the check judged every token, when
        it is a clear mismatch already (the third run decides), when the check was a
        scoring run itself, or when the plugin version cannot score."""
        if kind != "text" or _is_scoring(check):
            return None  # a scoring run is judged as it is, never scored again
        claimed = (primary.receipt or {}).get("outputs") or []
        if len(claimed) != 1 or len(cmp.details) != 1:
            return None  # a text job makes one output
        ids = (claimed[0].get("meta") or {}).get("token_ids")
        if (not isinstance(ids, list) or not ids or not needs_scoring(
                cmp.verdict, int(cmp.details[0].get("checked_tokens", 0)), len(ids),
                bool(cmp.details[0].get("text_checked", True)))):
            return None
        try:
            manifest = self.catalog.get(primary.plugin, primary.plugin_version)
        except Exception:  # noqa: BLE001 - a retired version: judge what there is
            return None
        if SCORE_INPUT not in manifest.inputs.names:
            return None
        return scoring_inputs(pinned_inputs(primary), ids)

    def _score_instead(self, v: Verification, primary: Job, check: Job, cmp: Judgement,
                       inputs: dict[str, Any]) -> None:
        """Queue a scoring run of the claim (teacher forcing, DESIGN §6), on a provider of
        another operator than the primary's, in place of the check run that parted from
        it: the record names the scoring run as its check, and that run's settlement is
        judged as the check's would have been. Not disguised, and needing none: the
        primary's run is committed, and its operator is excluded."""
        self._audit("verification.parted", primary.id,
                    {"check_job": check.id, "figures": cmp.figures(),
                     "receipts": {"primary": primary.receipt, "checker": check.receipt}})
        owner = self.providers.owner_of(primary.provider_id) or ""
        scoring = self._spawn(v, primary, Role.CHECKER, {owner} - {""},
                              client_pays=primary.verify == "always", inputs=inputs,
                              delay_s=0.0)
        if scoring is not None:
            self._event(primary.id, CheckStatus.CHECKING,
                        "the check's run parted from this one: a provider scores the "
                        "claimed tokens")

    def _finish(self, v: Verification, outcome: Outcome, jobs: dict[Role, Job],
                expect: CheckStatus) -> None:
        """Store the judgement (everything its effects need, marked not applied yet) in one
        conditional update that only one judge wins, then apply the effects (``_apply``),
        which sets the status last: whatever fails meanwhile, the record stays open and
        the sweep applies the rest."""
        status = {Status.VERIFIED: CheckStatus.VERIFIED, Status.OVERTURNED: CheckStatus.OVERTURNED,
                  Status.NONDETERMINISTIC: CheckStatus.NONDETERMINISTIC}[outcome.status]
        losers = {p.provider_id for p in outcome.penalties}
        record = {"status": status.value, "note": outcome.note,
                  "credits": [c.provider_id for c in outcome.credits],
                  "penalties": [{"provider_id": p.provider_id, "role": p.role.value,
                                 "forfeit_micro": p.forfeit_micro,
                                 "slash_micro": p.slash_micro,
                                 "claw_back": p.claw_back_micro > 0,
                                 "quota_factor": p.quota_factor} for p in outcome.penalties],
                  "runs": {role.value: j.id for role, j in jobs.items()},
                  "deliver_from": outcome.deliver_from,
                  "applied": False, "done": []}
        for kept in ("escalations", "dropped_tiebreaks", "dropped_operators", "check_tries",
                     "check_failed_by"):  # how the verdict was reached stays on the record
            if kept in (v.outcome or {}):
                record[kept] = v.outcome[kept]
        if Role.TIEBREAKER in jobs and self.disputes is not None:
            # each run's own first output, read before an overturn replaces any
            record["sides"] = self._sides(jobs, lambda job: "minority"
                                          if job.provider_id in losers else "majority")
        moved = self.repo.update(v.job_id, {expect}, expect_unjudged=True,
                                 comparisons=outcome.comparisons, outcome=record)
        if moved is None:
            return  # judged by another thread or replica
        self._apply(moved, jobs)

    def _apply(self, v: Verification, jobs: dict[Role, Job] | None = None) -> None:
        """Apply a judged record's effects: each run's standing and quota, the losers'
        refunds and slashes, the refund of a nondeterministic job, the majority's outputs
        for an overturned one, the audit entry, the dispute, then the status (so that a
        client who sees it sees its effects) and the client's event. Each step is done
        once: the steps done are listed in ``outcome["done"]`` (a standing is counted in
        the same transaction that lists it), ledger calls carry idempotency keys, and a
        slash's amount is fixed before it is taken. Run under ``self._lock``; an error
        leaves the record open with ``applied`` false, for the sweep to come back to."""
        record = dict(v.outcome or {})
        if record.get("applied", True):
            return
        if jobs is None:
            jobs = {}
            for role, job_id in (record.get("runs") or {}).items():
                job = self.jobs.repo.get(job_id)
                if job is None:
                    raise LookupError(f"verification of job {v.job_id}: run {job_id} is gone")
                jobs[Role(role)] = job
        primary = jobs[Role.PRIMARY]
        by_provider = {j.provider_id: j for j in jobs.values()}
        done: set[str] = set(record.get("done") or [])

        def save() -> None:
            record["done"] = sorted(done)
            self.repo.update(v.job_id, set(OPEN_STATUSES), outcome=record)

        def count(provider_id: str, step: str, **kw):
            job = by_provider[provider_id]
            hw = self._repro(job).hardware_class
            if step in done:
                return self.repo.standing(provider_id, job.plugin, hw)
            standing = self.repo.record_check(provider_id, job.plugin, hw,
                                              once=(v.job_id, step), **kw)
            done.add(step)
            return standing

        for provider_id in record.get("credits") or []:
            count(provider_id, f"credit:{provider_id}", valid=True)
        for entry in record.get("penalties") or []:
            provider_id = entry["provider_id"]
            job = by_provider[provider_id]
            standing = count(provider_id, f"penalty:{provider_id}", valid=False,
                             quota_factor=entry.get("quota_factor",
                                                    self.settings.penalty.quota_factor))
            self.on_quota(provider_id, self.repo.quota_factor(provider_id))
            if f"refund:{job.id}" not in done:
                self._refund(job, f"verification: outvoted on job {v.job_id}", strict=True)
                done.add(f"refund:{job.id}")
            owner = self.providers.owner_of(provider_id)
            if entry.get("claw_back") and f"claw:{provider_id}" not in done:
                self._claw_back(v, provider_id, owner, record, save)
                done.add(f"claw:{provider_id}")
                save()
            if f"slash:{provider_id}" in done:
                continue
            plan = record.setdefault("slash_plan", {})
            if provider_id not in plan:
                # what is at stake now (unstaking is refused while checks are open, but a
                # stake can only be slashed down to zero), fixed before it is taken so that
                # a retry asks the ledger for the same amount under the same key
                want = int(entry.get("slash_micro") or 0)
                plan[provider_id] = min(want, max(0, self.ledger.balances(owner).get(
                    AccountKind.PROVIDER_STAKE, 0))) if want > 0 and owner else 0
                if plan[provider_id] > 0:
                    save()
            amount, slashed, slash_txn = plan[provider_id], 0, None
            if amount > 0:
                try:
                    slash_txn = self.ledger.slash(
                        owner, amount, reason=f"lost the check of job {v.job_id}",
                        idempotency_key=f"verify:{v.job_id}:slash:{provider_id}").id
                    slashed = amount
                except lerr.LedgerBusy:
                    raise  # nothing written: the sweep retries
                except lerr.LedgerError:  # recorded; an admin reconciles
                    log.exception("slashing %s for job %s failed", owner, v.job_id)
                self._stakes.invalidate(owner)
            entry["slash_micro"] = slashed  # what was really taken
            if slash_txn:
                record.setdefault("slash_transactions", {})[provider_id] = slash_txn
            self._audit("verification.penalty", v.job_id,
                        {"provider": provider_id, "role": entry["role"],
                         "forfeit_micro": entry["forfeit_micro"],
                         "slash_micro": slashed, "slash_transaction": slash_txn,
                         "cv": standing.consecutive_valid, "quota_factor": standing.quota_factor})
            done.add(f"slash:{provider_id}")
            save()
        status = CheckStatus(record["status"])
        if status is CheckStatus.NONDETERMINISTIC and f"refund:{primary.id}" not in done:
            self._refund(primary, "verification: no two runs agree (nondeterministic job)",
                         strict=True)
            done.add(f"refund:{primary.id}")
        def once(step: str, effect) -> None:
            """``effect`` and the mark that it is done, in one transaction: a retry never
            repeats an effect that is not idempotent by itself (an event, an entry, a
            dispute)."""
            if step in done:
                return
            with self.jobs.repo.atomic():
                effect()
                done.add(step)
                save()

        winner = by_provider.get(record.get("deliver_from") or "")
        if status is CheckStatus.OVERTURNED and winner is not None:
            once("outputs", lambda: self.jobs.repo.replace_outputs(
                primary.id, [JobOutput(primary.id, o.index, o.sha256, o.media_type, o.size)
                             for o in self.jobs.repo.outputs(winner.id)],
                ("overturned", {"outputs_from": winner.id})))
        once("audit", lambda: self._audit(
            "verification.outcome", v.job_id,
            {**{k: val for k, val in record.items() if k not in _PENDING and k != "applied"},
             "figures": v.comparisons,
             "receipts": {role.value: j.receipt for role, j in jobs.items()}}))
        sides = record.get("sides") or []
        if sides and self.disputes is not None:
            once("dispute", lambda: self.disputes.open(
                v.job_id, primary.plugin, sides, v.comparisons,
                f"{status.value}: {record.get('note', '')}"))
        for key in _PENDING:
            record.pop(key, None)
        record["applied"] = True
        if self.repo.update(v.job_id, set(OPEN_STATUSES), status=status,
                            outcome=record) is not None:
            self._event(primary.id, status, record.get("note", ""))

    def _claw_back(self, v: Verification, provider_id: str, owner: str | None,
                   record: dict, save: Callable[[], None]) -> None:
        """Give back every credit of ``owner`` (the operator of ``provider_id``, which was
        clearly outvoted) that has not vested yet: each such hold is refunded to its client
        (DESIGN §6: credits vest after a window so that late findings can claw back). The
        holds are fixed at the first try (``claw_plan``) and each refund carries its own
        key, so a retry takes nothing twice; one that vested or was refunded meanwhile is
        skipped. Unvested credits are part of what the sampling counts a caught cheat
        loses (``PenaltyPolicy.claw_back_unvested``)."""
        plan = record.setdefault("claw_plan", {})
        if provider_id not in plan:
            plan[provider_id] = [h.id for h in self.ledger.unvested_holds(owner)] if owner else []
            save()
        refunded, skipped = [], []
        for hold_id in plan[provider_id]:
            refused = self._refund_hold(
                hold_id, f"verify:{v.job_id}:claw:{hold_id}",
                f"claw-back: provider {provider_id} lost the check of job {v.job_id}",
                strict=True)  # the sweep retries what raises
            if refused is None:
                refunded.append(hold_id)
            else:  # vested or refunded since the plan was made
                skipped.append({"hold": hold_id, "error": f"{type(refused).__name__}: {refused}"})
        self._audit("verification.claw_back", v.job_id,
                    {"provider": provider_id, "operator": owner, "holds": refunded,
                     "skipped": skipped})

    def _sides(self, jobs: dict[Role, Job], verdict) -> list[dict]:
        """A dispute's sides: each run's provider, role, first output and ``verdict(job)``."""
        sides = []
        for role, j in jobs.items():
            outs = self.jobs.repo.outputs(j.id)
            sides.append({"provider_id": j.provider_id, "job_id": j.id, "role": role.value,
                          "output_index": 0, "sha256": outs[0].sha256 if outs else "",
                          "media_type": outs[0].media_type if outs else "",
                          "verdict": verdict(j)})
        return sides

    def _refund(self, job: Job, reason: str, *, strict: bool = False) -> None:
        """Refund ``job``'s hold (once: the key is the job's). What the ledger refuses (its
        share vested already) is recorded for an admin; with ``strict`` anything else (the
        ledger busy, the database down) raises, for the caller to retry."""
        if job.hold_id is None:
            return
        refused = self._refund_hold(job.hold_id, f"verify:{job.id}:refund", reason,
                                    strict=strict)
        if isinstance(refused, lerr.AlreadyRefunded):
            # a claw-back (this provider lost another check) gave it back already
            log.info("job %s: %s", job.id, refused)
            return
        if refused is not None:
            log.warning("job %s: refund after verification failed: %s", job.id, refused)
            self._audit("verification.refund_failed", job.check_of or job.id,
                        {"job": job.id, "error": f"{type(refused).__name__}: {refused}"})

    def _refund_hold(self, hold_id: str, key: str, reason: str, *,
                     strict: bool) -> Exception | None:
        """Refund a posted hold under ``key``; returns what stopped it (None: refunded).
        With ``strict`` only the ledger's refusals come back (vested or refunded already);
        LedgerBusy, which wrote nothing, and errors of the broker's raise."""
        try:
            self.ledger.refund(hold_id, idempotency_key=key, reason=reason)
            return None
        except Exception as exc:  # noqa: BLE001 - returned or raised, never dropped
            if strict and (isinstance(exc, lerr.LedgerBusy)
                           or not isinstance(exc, lerr.LedgerError)):
                raise
            return exc

    # ---- helpers ----------------------------------------------------------------------
    def _output_kind(self, job: Job) -> str:
        try:
            return self.catalog.get(job.plugin, job.plugin_version).output
        except Exception:  # noqa: BLE001 - a retired version: judge bytes
            return "exact"

    def _load(self, job: Job) -> Callable[[], Run]:
        """Read ``job``'s outputs now (a failed read raises: the broker's trouble, never a
        provider's answer); what is returned builds the run from them and from the
        provider's receipt (its meta and reproducibility class), which ``_judge`` guards."""
        data = [(o, self.jobs.blobs.get(o.sha256)) for o in self.jobs.repo.outputs(job.id)]
        repro = self._repro(job)

        def run() -> Run:
            metas = {int(o.get("index", i)): dict(o.get("meta") or {})
                     for i, o in enumerate((job.receipt or {}).get("outputs", []))}
            return Run(tuple(RunOutput(blob, o.media_type, metas.get(o.index, {}))
                             for o, blob in data), repro,
                       scored=_is_scoring(job), inputs=dict(job.inputs or {}), job_id=job.id)
        return run

    def _repro(self, job: Job) -> ReproClass:
        """The reproducibility class of ``job``'s run as the broker knows it (issue #20):
        what its machine declared for the job's plugin build when the broker assigned the
        run, recorded in its envelope (``broker.jobs.repro``), with the weights the broker
        pinned there. Never the receipt's ``repro`` (a provider that named another class
        there switched exact comparison to structural at will), nor what the machine
        declares later (a reconnect). An envelope written before the class was recorded:
        what the machine declared last."""
        weights = (job.envelope or {}).get("weights_digest") or job.weights_digest
        recorded = recorded_class(job.envelope)
        if recorded is None:
            recorded = self.providers.declared_repro(job.provider_id, job.plugin,
                                                     job.plugin_version)
            weights = weights or recorded.get("weights_digest")
        return declared_repro(job.provider_id or "", job.plugin, job.plugin_version,
                              recorded, weights or "")

    def _declared(self, provider_id: str, plugin: str, version: str) -> ReproClass:
        """The class machine ``provider_id`` declared at connect for ``plugin@version``; a
        part it did not declare is its own (``undeclared:<id>``), equal to no other's, so
        its runs are compared structurally. Canaries check the declaration: answers that
        differ from the known answer of the declared class fail them."""
        d = self.providers.declared_repro(provider_id, plugin, version)
        return declared_repro(provider_id, plugin, version, d, d.get("weights_digest") or "")

    def _party(self, job: Job, role: Role) -> Party:
        owner = self.providers.owner_of(job.provider_id) or job.provider_id or ""
        balances = self.ledger.balances(owner) if owner else {}
        gain, _ = self._hold_figures(job)
        return Party(provider_id=job.provider_id or "", operator_id=owner, role=role,
                     receipt_id=job.id,
                     stake_micro=max(0, balances.get(AccountKind.PROVIDER_STAKE, 0)),
                     unvested_micro=max(0, balances.get(AccountKind.PROVIDER_VESTING, 0)),
                     job_credits_micro=gain)

    def _event(self, job_id: str, status: CheckStatus, note: str) -> None:
        try:
            self.jobs.repo.add_event(job_id, "verification", {"status": status.value,
                                                              "note": note})
            self.jobs.hub.notify(job_id)
        except Exception:  # noqa: BLE001
            log.exception("job %s: could not record its verification event", job_id)

    def _audit(self, action: str, job_id: str, data: dict[str, Any]) -> None:
        if self.audit is not None:
            self.audit.record("verification", action, f"job:{job_id}", data)


def _judge(kind: str, claimed: Callable[[], Run], check: Callable[[], Run]) -> Judgement:
    """``judge`` on two runs whose outputs were read already (``_load``); what the providers
    supplied that cannot be parsed or compared (not an image, malformed token ids, a bad
    receipt meta) is a mismatch, never an error that would leave the check open for ever."""
    try:
        return judge(kind, claimed(), check())
    except Exception as exc:  # noqa: BLE001 - provider-supplied bytes and meta
        return Judgement(Verdict.MISMATCH, "unreadable",
                         reasons=(f"the outputs could not be compared: "
                                  f"{type(exc).__name__}: {exc}"[:300],))


#: Keys of a judged record's ``outcome`` that only serve applying its effects (``_apply``).
_PENDING = ("done", "sides", "slash_plan", "claw_plan")


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


def _answer_of(receipt: dict) -> str:
    """A run's answer, as canaries compare them: its outputs' indexes and sha256s."""
    return sha256_hex(canonical_bytes(sorted(
        [int(o.get("index", i)), str(o.get("sha256", ""))]
        for i, o in enumerate(receipt.get("outputs", [])))))
