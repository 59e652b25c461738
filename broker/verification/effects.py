"""What an outcome does, each step recorded on the verification record so that a crash
resumes it: the loser's credits clawed back, stake slashed, quota cut, the majority's
outputs on an overturned job, refunds, audit entries and job events.

A part of :class:`broker.verification.service.VerificationService`.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from broker.jobs.model import Job, JobOutput
from broker.ledger import errors as lerr
from broker.ledger.model import AccountKind
from broker.verification.outcomes import Role
from broker.verification.records import OPEN_STATUSES, CheckStatus, Verification
from broker.verification.sampled_text import SamplingState

log = logging.getLogger(__name__)


def claim_log_e(comparison: dict[str, Any] | None) -> float | None:
    """The least sampled-text log e-value one comparison (``primary~checker`` or
    ``primary~tiebreaker``) gave the primary's claim over its outputs, None when it tested
    none. Figures keep three decimals: 0.0005 is taken off so that the stored value is
    never above the e-value computed."""
    found = []
    for out in (comparison or {}).get("outputs") or []:
        sampling = out.get("sampling") if isinstance(out, dict) else None
        if isinstance(sampling, dict) and isinstance(sampling.get("log_e"), (int, float)):
            found.append(float(sampling["log_e"]) - 0.0005)
    return min(found) if found else None


def sampling_figure(log_e: float, state: SamplingState) -> dict[str, Any]:
    """What a record's outcome keeps of the checker's e-value compounded
    (``outcome["sampling"]``): the e-value and the witness's process after it."""
    return {"primary~checker": {"log_e": round(log_e, 3), "checks": state.checks,
                                "log_m": round(state.log_m, 3)}}


def _sampling_step(primary: Job, witness: str) -> str:
    """The record's step that marks the checker's e-value compounded."""
    return f"sampling:{primary.provider_id}:{witness}"


#: Keys of a judged record's ``outcome`` that only serve applying its effects (``_apply``).
_PENDING = ("done", "sides", "slash_plan", "claw_plan")


class VerificationEffects:
    """Applying outcomes (a part of VerificationService)."""

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
                job = self.jobs.get(job_id)
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
            self.quotas.set_quota(provider_id, self.repo.quota_factor(provider_id))
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
        self._compound_sampling(v, record, primary, done)
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
            with self.jobs.atomic():
                effect()
                done.add(step)
                save()

        winner = by_provider.get(record.get("deliver_from") or "")
        if status is CheckStatus.OVERTURNED and winner is not None:
            once("outputs", lambda: self.jobs.replace_outputs(
                primary.id, [JobOutput(primary.id, o.index, o.sha256, o.media_type, o.size)
                             for o in self.jobs.outputs(winner.id)],
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

    def _compound_sampling(self, v: Verification, record: dict, primary: Job,
                           done: set[str]) -> None:
        """Compound the judged claim's sampled-text e-value into its provider's evidence
        across checks (``sampled_text.SamplingState``), once per claim: the checker's run
        adds the e-value its comparison gave to the e-process of its operator, the witness.
        Kept per witness because the e-values come from the witness's own scores: one
        operator that inflated them can raise only its own process, and a dispute's third
        run is judged on the third run's operator's (``VerificationVerdicts._prior``), so
        compounding cannot frame an honest provider without two unlinked operators lying
        together, as a single check could not. Only the checker's e-value enters: which
        claims are checked is the broker's draw, so each e-value has expectation at most 1
        given the past (Ville's bound holds), while a third run is drawn only for a claim
        already disputed, often on the same tokens' sampling evidence, and its e-value on
        them would be biased upwards (on honest text, a checker's e^3 makes a third run's
        mean e-value about 90, not 1). A claim outvoted on clear mismatches (grounds for a
        slash) closes every witness's process instead, and fresh ones start. A disputed
        claim's e-value was added when the check disputed it (``VerificationVerdicts``):
        its step is in ``done`` then, and nothing more is added here."""
        if not primary.provider_id:
            return
        clear = any(e["provider_id"] == primary.provider_id
                    # a record judged before "clear" was stored: a clear loss cut the quota
                    and e.get("clear", bool(e.get("claw_back"))
                              or float(e.get("quota_factor", 1.0)) < 1.0)
                    for e in record.get("penalties") or [])
        if clear:
            step = f"sampling:{primary.provider_id}"
            if step not in done:
                self.repo.close_sampling_evidence(primary.provider_id, primary.plugin,
                                                  once=(v.job_id, step))
                done.add(step)
                self._audit("verification.sampling_closed", v.job_id,
                            {"provider": primary.provider_id, "plugin": primary.plugin})
            return
        log_e = claim_log_e(v.comparisons.get("primary~checker"))
        if log_e is None or not v.checker_job_id:
            return  # the check tested no sampled text
        checker = self.jobs.get(v.checker_job_id)
        if checker is None:
            return
        witness = self._witness(checker)
        if _sampling_step(primary, witness) in done:
            return  # added when the check disputed the claim
        state = self._compound_checker(v.job_id, primary, witness, log_e)
        done.add(_sampling_step(primary, witness))
        record["sampling"] = sampling_figure(log_e, state)

    def _compound_checker(self, job_id: str, primary: Job, witness: str,
                          log_e: float) -> SamplingState:
        """Compound the sampled-text e-value e^``log_e`` that a check run by ``witness`` (an
        operator) gave the primary's claim into that witness's e-process, once per claim:
        the step's mark (``_sampling_step``) is written into the record of ``job_id`` with
        it, so the check's judgement can add it when it disputes the claim and the
        outcome's effects later find it done. The witness's state after it (as it stands,
        when the step was marked already)."""
        return self.repo.add_sampling_evidence(primary.provider_id, primary.plugin, witness,
                                               log_e, once=(job_id,
                                                            _sampling_step(primary, witness)))

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
            outs = self.jobs.outputs(j.id)
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

    def _event(self, job_id: str, status: CheckStatus, note: str) -> None:
        try:
            self.jobs.add_event(job_id, "verification", {"status": status.value,
                                                         "note": note})
        except Exception:  # noqa: BLE001
            log.exception("job %s: could not record its verification event", job_id)

    def _audit(self, action: str, job_id: str, data: dict[str, Any]) -> None:
        if self.audit is not None:
            self.audit.record("verification", action, f"job:{job_id}", data)
