"""Judging a settled check against the run it checks: the comparison (broker.verification.
judging), a third run when they disagree or a text check parts from the claim (scored
by teacher forcing instead), whose word counts when operators are linked (issue #20),
and the outcome recorded.

A part of :class:`broker.verification.service.VerificationService`.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from broker.jobs.model import Job
from broker.jobs.repro import recorded_class
from broker.ledger.model import AccountKind
from broker.verification.comparators import ReproClass, Verdict
from broker.verification.effects import claim_log_e, sampling_figure
from broker.verification.judging import (SCORE_INPUT, Judgement, Run, RunOutput,
                                         StoredJudgement, declared_repro, judge,
                                         needs_scoring, scoring_inputs)
from broker.verification.outcomes import (Outcome, Party, Role, Status, resolve_pair,
                                          resolve_three)
from broker.verification.records import CheckStatus, Verification
from broker.verification.sampled_text import SamplingState
from broker.verification.runs import _is_scoring, _third_run_of, pinned_inputs

log = logging.getLogger(__name__)


class VerificationVerdicts:
    """Judging runs into an outcome (a part of VerificationService)."""

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
            primary = self.jobs.get(v.job_id)
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
                cmp = _judge(kind, self._load(primary, prior=self._prior(kind, primary, check)),
                             self._load(check))
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
                    # The checker's word counts from now on, not once the third run is
                    # judged: the provider's next claims, checked meanwhile, are judged with
                    # it (a burst of cheated claims is judged one after another). Added, and
                    # marked done, before the dispute is recorded, so that the third run
                    # (queued only once it is) always finds the mark; a judge that stops in
                    # between judges the check again and finds it added.
                    log_e = claim_log_e(outcome.comparisons.get("primary~checker"))
                    kept = dict(v.outcome or {})
                    if log_e is not None and primary.provider_id:
                        state = self._compound_checker(v.job_id, primary,
                                                       self._witness(check), log_e)
                        kept = dict((self.repo.get(v.job_id) or v).outcome or {})  # its mark
                        kept["sampling"] = sampling_figure(log_e, state)
                    moved = self.repo.update(
                        v.job_id, {CheckStatus.CHECKING}, status=CheckStatus.DISPUTED,
                        comparisons=outcome.comparisons,
                        outcome={**kept, "note": outcome.note})
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
                checker = self.jobs.get(v.checker_job_id)
                runs = {Role.PRIMARY: self._load(primary,
                                                 prior=self._prior(kind, primary, check)),
                        Role.CHECKER: self._load(checker), Role.TIEBREAKER: self._load(check)}
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
        with self.jobs.atomic():
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
                                 "clear": p.clear,
                                 "quota_factor": p.quota_factor} for p in outcome.penalties],
                  "runs": {role.value: j.id for role, j in jobs.items()},
                  "deliver_from": outcome.deliver_from,
                  "applied": False,
                  # steps done before the verdict (the checker's e-value, compounded when
                  # the claim was disputed) stay done
                  "done": list((v.outcome or {}).get("done") or [])}
        for kept in ("escalations", "dropped_tiebreaks", "dropped_operators", "check_tries",
                     "check_failed_by", "sampling"):  # how the verdict was reached stays
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

    # ---- helpers ----------------------------------------------------------------------
    def _output_kind(self, job: Job) -> str:
        try:
            return self.catalog.get(job.plugin, job.plugin_version).output
        except Exception:  # noqa: BLE001 - a retired version: judge bytes
            return "exact"

    def _prior(self, kind: str, primary: Job, witness: Job) -> SamplingState | None:
        """The sampled-text evidence of the primary's provider from its earlier checked
        claims of the plugin, as the operator of ``witness`` (the run this claim is judged
        against) gave it, which a text check of this claim compounds with (issue #20: a
        claim sampled from a narrower nucleus than asked is caught over several checks);
        None for other kinds of output. Only that operator's own earlier word counts: the
        e-values come from the witness's scores, which the broker cannot recompute, and an
        operator that inflated them against an honest provider must not lend that to the
        third run that judges the dispute (it would then cross by the prior alone)."""
        if kind != "text" or not primary.provider_id:
            return None
        return self.repo.sampling_state(primary.provider_id, primary.plugin,
                                        self._witness(witness))

    def _witness(self, job: Job) -> str:
        """The operator whose run ``job`` is: whose word its e-values are."""
        return self.providers.owner_of(job.provider_id) or job.provider_id or ""

    def _load(self, job: Job, prior: SamplingState | None = None) -> Callable[[], Run]:
        """Read ``job``'s outputs now (a failed read raises: the broker's trouble, never a
        provider's answer); what is returned builds the run from them and from the
        provider's receipt (its meta and reproducibility class), which ``_judge`` guards.
        ``prior``: the run's provider's sampled-text evidence (``_prior``), for a claim."""
        data = [(o, self.jobs.output_bytes(o.sha256)) for o in self.jobs.outputs(job.id)]
        repro = self._repro(job)

        def run() -> Run:
            metas = {int(o.get("index", i)): dict(o.get("meta") or {})
                     for i, o in enumerate((job.receipt or {}).get("outputs", []))}
            return Run(tuple(RunOutput(blob, o.media_type, metas.get(o.index, {}))
                             for o, blob in data), repro,
                       scored=_is_scoring(job), inputs=dict(job.inputs or {}), job_id=job.id,
                       prior=prior)
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
