"""Verification as the parts built before it see it.

Verification needs the dispatcher (the quota it cuts, ``VerificationService(quotas=...)``)
and the console's dispute service, which needs the dispatcher too; yet the dispatcher asks
verification whether a provider holds a plugin's stake, the canaries (built before the
dispatcher) hand it each canary's answer, and the dispute service hands it an admin's
override. So the wiring (``broker/services.py``) builds this relay first, passes it to
those three at construction (``Dispatcher(stakes=...)``, ``CanaryService(answers=...)``,
``DisputeService(resolutions=...)``) and joins the verification service to it once that
is built. With verification off nothing is joined, and each answers as if there were no
verification: every provider holds enough stake, nobody compares canaries' answers, an
override is recorded and nothing more.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from broker.admin.disputes import Dispute
    from broker.verification.service import VerificationService


class VerificationRelay:
    """A :class:`broker.jobs.ports.StakeCheck`, :class:`broker.market.canary.CanaryAnswers`
    and :class:`broker.admin.disputes.Resolutions` that passes each call to the
    verification service joined to it."""

    def __init__(self) -> None:
        self._verification: VerificationService | None = None

    def join(self, verification: VerificationService) -> None:
        """Pass the calls from now on to ``verification`` (once, while wiring)."""
        if self._verification is not None and self._verification is not verification:
            raise ValueError("a verification service is already joined to this relay")
        self._verification = verification

    def stake_ok(self, provider_id: str, plugin: str) -> bool:
        v = self._verification
        return True if v is None else v.stake_ok(provider_id, plugin)

    def canary_answer(self, provider_id: str, plugin: str, version: str, inputs: dict,
                      receipt: dict, source: str = "",
                      recorded: dict | None = None) -> str | None:
        v = self._verification
        if v is None:
            return None
        return v.canary_answer(provider_id, plugin, version, inputs, receipt, source, recorded)

    def canary_unanswered(self, provider_id: str, plugin: str, version: str,
                          recorded: dict | None, why: str, away: bool = False) -> str | None:
        v = self._verification
        if v is None:
            return None
        return v.canary_unanswered(provider_id, plugin, version, recorded, why, away)

    def admin_resolved(self, dispute: Dispute) -> None:
        v = self._verification
        if v is not None:
            v.admin_resolved(dispute)
