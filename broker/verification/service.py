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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from sdk.protocol.canonical import canonical_bytes, sha256_hex

from broker.cache import TtlCache
from broker.jobs.model import Job, JobState
from broker.links.service import unlinked_pair
from broker.ledger.model import AccountKind
from broker.verification.comparators import THRESHOLDS_PATH, ReproClass
from broker.verification.judging import declared_repro
from broker.verification.outcomes import PenaltyPolicy, Role
from broker.verification.records import CheckStatus, Verification, VerificationRepository
from broker.verification.effects import VerificationEffects
from broker.verification.ports import CheckedJobs
from broker.verification.recovery import VerificationRecovery
from broker.verification.runs import VerificationRuns, _rerun_of, _third_run_of
from broker.verification.verdicts import VerificationVerdicts

log = logging.getLogger(__name__)

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
    # Canaries not answered (past their deadline, failed, or given back for an owner the
    # agent never said had come back): of a provider's last ``canary_window`` canaries of
    # a plugin, the first ``canary_misses_excused`` misses cost nothing (a crash, a dropped
    # link); each miss beyond them counts as a wrong answer does (a failed check: CV reset,
    # quota cut; never money nor stake: canaries are unpaid). Canaries the agent was away
    # from — given back for the machine's owner (an idle-only agent whose owner came back),
    # or out when its stream left the replica that sent them (it may have answered on the
    # one it moved to, which does not know the canary) — have their own allowance,
    # ``canary_away_excused`` of the window: an honest machine's owner seldom comes back,
    # and its link seldom drops, during the seconds a canary runs, while an agent that
    # could tell canaries would do either around every one of them.
    canary_window: int = 8
    canary_misses_excused: int = 1
    canary_away_excused: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.canary_window <= 64 or not 0 <= self.canary_misses_excused < \
                self.canary_window or not 0 <= self.canary_away_excused < self.canary_window:
            raise ValueError(f"need 1 <= canary_window <= 64 and 0 <= canary_misses_excused, "
                             f"canary_away_excused < canary_window: {self.canary_window}, "
                             f"{self.canary_misses_excused}, {self.canary_away_excused}")


class Links(Protocol):
    """What verification needs of ``broker.links.LinkService``: which operator accounts
    the broker has seen tied to one another."""

    def linked_to(self, account_id: str) -> frozenset[str]: ...

    def linked(self, a: str, b: str) -> bool: ...

    def why(self, a: str, b: str) -> list[str]: ...


class Quotas(Protocol):
    """Who scales a provider's concurrency by the quota its lost checks left it
    (broker.jobs.dispatch.Dispatcher)."""

    def set_quota(self, provider_id: str, factor: float) -> None: ...


class _NoQuotas:
    """Nobody scales slots (no dispatcher): the quota stays in verification's records."""

    def set_quota(self, provider_id: str, factor: float) -> None:
        return None


class VerificationService(VerificationRuns, VerificationVerdicts, VerificationEffects,
                          VerificationRecovery):
    """Checks of settled jobs from the draw to the outcome. This file holds the hooks from
    the job service, canaries and reads; the parts: runs.py (sampling, queueing check
    runs), verdicts.py (judging), effects.py (applying outcomes), recovery.py (the sweep,
    admin resolutions)."""

    def __init__(self, repo: VerificationRepository, jobs: CheckedJobs, catalog, ledger,
                 providers, policies, *, disputes=None, audit=None,
                 rng: random.Random | None = None, clock: Callable[[], float] = time.time,
                 settings: VerificationSettings | None = None, links: Links | None = None,
                 quotas: Quotas | None = None):
        self.repo = repo
        self.links = links  # operators tied to one another: never each other's checkers
        self.jobs = jobs  # the job service, through the port (broker.verification.ports)
        self.catalog = catalog
        self.ledger = ledger
        self.providers = providers
        self.policies = policies  # broker.pricing.policy.PolicyService
        self.disputes = disputes
        self.audit = audit
        self.rng = rng or random.SystemRandom()
        self.clock = clock
        self.settings = settings or VerificationSettings()
        self.quotas = quotas or _NoQuotas()  # the dispatcher scales slots
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
        primary = self.jobs.get(v.job_id)
        if primary is not None and tries < self.settings.check_tries:
            with self.jobs.atomic():
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
        primary = self.jobs.get(v.job_id)
        checker = self.jobs.get(v.checker_job_id) if v.checker_job_id else None
        if primary is None or checker is None:
            return
        if tries < self.settings.tiebreak_tries:
            # The try is counted with the run it queues: a queueing that fails counts none
            # (the sweep finds the failed run again and retries).
            with self.jobs.atomic():
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

    # ---- canaries -------------------------------------------------------------------
    def _canary_key(self, repro: ReproClass, plugin: str, version: str, inputs: dict) -> str:
        return sha256_hex(canonical_bytes({"plugin": plugin, "version": version,
                                           "inputs": inputs, "repro": repro.__dict__}))

    def _learn_from(self, source: str, plugin: str, version: str, inputs: dict) -> None:
        """The client job whose inputs a canary reused is its operator's answer for them,
        in its provider's class: recorded (once) before the canary is compared, so that a
        canary of another operator in that class makes the answer known."""
        job = self.jobs.get(source)
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
        not linked to each other (``broker.links``) returned it; a canary that disagrees
        with a known answer counts as a failed check (CV reset, quota cut; no money:
        canaries are unpaid), one that agrees as a valid check. ``source``: the client job
        whose inputs the canary reused (its answer counts for its own operator);
        ``recorded``: the class (and weights) its envelope recorded when it was sent
        (``Canary.repro``; None: what the machine declared last). Returns "learning",
        "valid", "invalid" or "ambiguous"."""
        repro = (self._declared(provider_id, plugin, version) if recorded is None else
                 declared_repro(provider_id, plugin, version, recorded,
                                str(recorded.get("weights_digest") or "")))
        key = self._canary_key(repro, plugin, version, inputs)
        answer = _answer_of(receipt)
        self.repo.canary_outcome(provider_id, plugin, "a", self.settings.canary_window)
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
            self.quotas.set_quota(provider_id, self.repo.quota_factor(provider_id))
        if self.audit is not None:
            self.audit.record("verification", "verification.canary", f"provider:{provider_id}",
                              {"plugin": plugin, "valid": valid, "answer": answer,
                               "known": known[0], "cv": standing.consecutive_valid,
                               "receipt": receipt})
        return "valid" if valid else "invalid"

    def canary_unanswered(self, provider_id: str, plugin: str, version: str,
                          recorded: dict | None, why: str, away: bool = False) -> str:
        """A canary the provider did not answer: no receipt within its deadline, a failure
        it reported, or a give-back for an owner it never said had come back
        (``CanaryService``). Were that free, an agent that could tell a canary would dodge
        every known-answer check by not answering. Of its last ``canary_window`` canaries
        of the plugin, the first ``canary_misses_excused`` misses are excused (an honest
        machine crashes now and then); each further miss is a failed check, as a wrong
        answer is (CV reset, quota cut; no money, no stake). ``away``: given back for the
        machine's owner, who the agent said had come back (idle-only mode), or out when the
        agent's stream left this replica: counted apart ("o"), the first
        ``canary_away_excused`` of the window excused. Returns "excused"
        or "failed"."""
        outcome = "o" if away else "m"
        recent = self.repo.canary_outcome(provider_id, plugin, outcome,
                                          self.settings.canary_window)
        misses = recent.count(outcome)
        failed = misses > (self.settings.canary_away_excused if away else
                           self.settings.canary_misses_excused)
        repro = (self._declared(provider_id, plugin, version) if recorded is None else
                 declared_repro(provider_id, plugin, version, recorded,
                                str(recorded.get("weights_digest") or "")))
        cv = None
        if failed:
            standing = self.repo.record_check(provider_id, plugin, repro.hardware_class,
                                              valid=False,
                                              quota_factor=self.settings.penalty.quota_factor)
            cv = standing.consecutive_valid
            self.quotas.set_quota(provider_id, self.repo.quota_factor(provider_id))
        if self.audit is not None:
            self.audit.record("verification", "verification.canary_unanswered",
                              f"provider:{provider_id}",
                              {"plugin": plugin, "why": why, "away": away,
                               "recent": recent,
                               "misses": misses, "counted": "failed" if failed else "excused",
                               "cv": cv})
        return "failed" if failed else "excused"

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

def _answer_of(receipt: dict) -> str:
    """A run's answer, as canaries compare them: its outputs' indexes and sha256s."""
    return sha256_hex(canonical_bytes(sorted(
        [int(o.get("index", i)), str(o.get("sha256", ""))]
        for i, o in enumerate(receipt.get("outputs", [])))))
