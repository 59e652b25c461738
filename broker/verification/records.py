"""What verification remembers: one record per checked-or-not job, and each provider's
standing per (plugin, hardware class). Plain values; storage implements the port below."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from broker.verification.sampled_text import SamplingState


class CheckStatus(str, enum.Enum):
    """A client job's verification status, as the API and the SDK show it."""

    UNCHECKED = "unchecked"                # not sampled (or no checker could be found)
    CHECKING = "checking"                  # a check run is queued or running
    VERIFIED = "verified"                  # another provider's run agrees
    DISPUTED = "disputed"                  # the runs disagree; a third provider decides
    OVERTURNED = "overturned"              # the output was wrong: refunded, replaced
    NONDETERMINISTIC = "nondeterministic"  # no two runs agree: refunded, nobody slashed


#: Statuses whose check is still running or awaiting its third run (or an admin).
OPEN_STATUSES = (CheckStatus.CHECKING, CheckStatus.DISPUTED)

#: How a provider met a canary: answered ("a"), not answered ("m": no receipt in time, a
#: failure, a give-back for no owner), or away from it ("o": given back for its machine's
#: owner, or out when its stream left the replica that sent it).
CANARY_OUTCOMES = frozenset("amo")


@dataclass
class Verification:
    job_id: str               # the client's job
    plugin: str
    provider_id: str          # who ran it
    hardware_class: str
    status: CheckStatus
    p: float                  # the check probability drawn against
    reason: str               # which sampling rule set p
    draw: float
    checker_job_id: str | None = None
    tiebreak_job_id: str | None = None
    comparisons: dict[str, Any] = field(default_factory=dict)
    outcome: dict[str, Any] | None = None
    created_at: float = 0.0
    updated_at: float = 0.0


@dataclass
class StandingRecord:
    provider_id: str
    plugin: str
    hardware_class: str
    consecutive_valid: int = 0   # CV
    checks: int = 0              # checks judged (as primary, checker or tiebreaker)
    failures: int = 0            # of which lost
    quota_factor: float = 1.0    # multiplies the provider's concurrency (lost disputes cut it)


class VerificationRepository(Protocol):
    def add(self, v: Verification) -> tuple[Verification, bool]:
        """Insert; (record, True), or (the existing record, False) when the job has one."""

    def get(self, job_id: str) -> Verification | None: ...

    def by_check_job(self, check_job_id: str) -> Verification | None: ...

    def update(self, job_id: str, expect: set[CheckStatus], *, expect_tiebreak: str | None = None,
               expect_checker: str | None = None, expect_unjudged: bool = False,
               **fields) -> Verification | None:
        """Change a record whose status is in ``expect`` (and whose third run is
        ``expect_tiebreak``, whose check run is ``expect_checker``, when given; and that
        holds no stored judgement yet, i.e. no ``outcome["applied"]``, with
        ``expect_unjudged``); None when it moved meanwhile."""

    def touch(self, job_id: str) -> None: ...

    def open_for(self, provider_ids: list[str]) -> int: ...

    def standing(self, provider_id: str, plugin: str, hardware_class: str) -> StandingRecord: ...

    def record_check(self, provider_id: str, plugin: str, hardware_class: str, *, valid: bool,
                     quota_factor: float | None = None,
                     once: tuple[str, str] | None = None) -> StandingRecord:
        """Count one judged check: CV + 1 when valid, else CV = 0 (and the quota factor
        multiplied by ``quota_factor``), atomically. With ``once=(job_id, step)`` only when
        ``step`` is not yet in that record's ``outcome["done"]`` (nor its effects all
        applied), adding it there in the same transaction (re-applying an outcome never
        counts a check twice)."""

    def standings(self, provider_id: str) -> list[StandingRecord]: ...

    def quota_factor(self, provider_id: str) -> float: ...

    def recent(self, limit: int = 100, status: CheckStatus | None = None) -> list[Verification]: ...

    def undecided(self, since: float, until: float, limit: int = 100) -> list[Any]:
        """Settled client jobs (``Job``) with no record yet."""

    def open_since(self, before: float, limit: int = 100, *,
                   queued_before: float | None = None) -> list[Verification]:
        """Open records the sweep may act on (their current run is missing, ended, or
        queued since before ``queued_before``), oldest change first."""

    def sampling_state(self, provider_id: str, plugin: str, witness: str) -> SamplingState:
        """The provider's sampled-text evidence across its checked claims of ``plugin`` as
        ``witness`` (an operator) gave it (a fresh ``SamplingState`` when it has none)."""

    def add_sampling_evidence(self, provider_id: str, plugin: str, witness: str,
                              log_e: float, *,
                              once: tuple[str, str] | None = None) -> SamplingState:
        """Compound one more checked claim's e-value, as ``witness``'s run gave it, into
        that witness's e-process (``SamplingState.after``), atomically. ``once`` as for
        ``record_check``."""

    def close_sampling_evidence(self, provider_id: str, plugin: str, *,
                                once: tuple[str, str] | None = None) -> None:
        """Close every witness's e-process of the provider's ``plugin`` (after a slash): each
        starts afresh. ``once`` as for ``record_check``."""

    def canary_outcome(self, provider_id: str, plugin: str, outcome: str,
                       window: int) -> str:
        """Record how the provider met a canary of ``plugin`` (one of
        :data:`CANARY_OUTCOMES`); returns its last ``window`` canaries after, oldest
        first."""

    def answers(self, key: str) -> dict[str, list[str]]: ...

    def add_answer(self, key: str, answer: str, operator: str) -> list[str]: ...
