"""Catching up: the sweep that finishes what a crash or a missed hook left (a settled job
never drawn, a check never queued or judged, an outcome half applied), and disputes an
admin resolved.

A part of :class:`broker.verification.service.VerificationService`.
"""
from __future__ import annotations

import logging

from broker.jobs.model import JobOutput, JobState
from broker.verification.outcomes import Role
from broker.verification.records import CheckStatus, Verification
from broker.verification.runs import _third_run_of

log = logging.getLogger(__name__)


class VerificationRecovery:
    """The sweep and admin resolutions (a part of VerificationService)."""

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
            check = self.jobs.get(current) if current else None
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
            if current and self.jobs.get(current) is not None:
                return 0  # queued meanwhile
            primary = self.jobs.get(v.job_id)
            checker = (self.jobs.get(v.checker_job_id)
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
        """An admin overrode a dispute (``DisputeService.override``, through its
        ``resolutions``): the chosen run's output stands. The client's job gets that run's
        outputs; a slash of that run's provider is reversed; a stalled dispute (no
        majority) also refunds the client when its job's run lost. Refunds already made
        stay made (the ledger corrects only by reversal, and a refund is final): the audit
        log says so."""
        with self._lock:  # not while a judgement's effects are being applied to the record
            self._admin_resolved(dispute)

    def _admin_resolved(self, dispute) -> None:
        v = self.repo.get(dispute.job_id)
        winner = (dispute.resolution or {}).get("winner_provider_id")
        primary = self.jobs.get(dispute.job_id)
        if v is None or primary is None or not winner:
            return
        runs = [j for j in (primary,
                            self.jobs.get(v.checker_job_id) if v.checker_job_id else None,
                            self.jobs.get(v.tiebreak_job_id) if v.tiebreak_job_id else None)
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
                 for o in self.jobs.outputs(win.id)])
        if [o.sha256 for o in outs] != [o.sha256 for o in self.jobs.outputs(primary.id)]:
            self.jobs.replace_outputs(primary.id, outs,
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
