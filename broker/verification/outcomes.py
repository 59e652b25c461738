"""What follows a check: 2-of-3 majority resolution as pure decisions (DESIGN §6).

``resolve_pair`` judges the first provider and its checker; on anything but a match it
asks for a third provider. ``resolve_three`` takes the three pairwise comparisons and
decides: the provider left alone by the majority loses (forfeits the job's credits to the
client, has part of its stake slashed and its unvested credits clawed back, CV reset to 0,
concurrency quota cut), whether it ran the job or checked it. When all three disagree the
job is nondeterministic: the client is refunded and nobody is slashed.

The functions return plain values saying what to do; the wiring applies them through the
ledger and provider registry and writes each one to the audit log with both receipts and
the comparison figures (``Comparison.figures``). A grey-zone comparison (``TIEBREAK``)
counts as "not agreeing" for the majority but never slashes: a provider outvoted 2-to-1
is slashed only when both its comparisons are clear mismatches; outvoted on a grey one it
forfeits the job's credits and its CV, never stake, unvested credits or quota.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from broker.verification.comparators import Verdict


class Comparison(Protocol):
    verdict: Verdict

    def figures(self) -> dict[str, Any]: ...


class Role(str, Enum):
    PRIMARY = "primary"        # ran the client's job
    CHECKER = "checker"        # re-ran it as a check
    TIEBREAKER = "tiebreaker"  # the third run after a disagreement


class Status(str, Enum):
    """The verification status of the client's output (as the SDK shows it)."""

    VERIFIED = "verified"                  # the output stands, confirmed by another run
    DISPUTED = "disputed"                  # waiting for the third provider
    OVERTURNED = "overturned"              # the output was wrong; the majority's replaces it
    NONDETERMINISTIC = "nondeterministic"  # no two runs agree: refunded, nobody slashed


@dataclass(frozen=True)
class Party:
    provider_id: str
    operator_id: str
    role: Role
    receipt_id: str
    stake_micro: int = 0
    unvested_micro: int = 0
    job_credits_micro: int = 0  # what this run earns (forfeited if it loses)


@dataclass(frozen=True)
class PenaltyPolicy:
    slash_fraction: float = 0.10   # of the loser's stake
    quota_factor: float = 0.5      # the loser's concurrency quota is multiplied by this
    claw_back_unvested: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.slash_fraction <= 1.0 or not 0.0 <= self.quota_factor <= 1.0:
            raise ValueError(f"slash_fraction and quota_factor must be within [0, 1]: {self}")


@dataclass(frozen=True)
class Penalty:
    provider_id: str
    role: Role
    forfeit_micro: int      # the run's credits, returned to the client
    slash_micro: int        # taken from stake
    claw_back_micro: int    # unvested credits taken back
    reset_cv: bool = True
    quota_factor: float = 0.5
    # outvoted on clear mismatches only (slashable); False: on a grey-zone comparison
    clear: bool = True


@dataclass(frozen=True)
class Credit:
    """A provider whose run the majority confirmed: CV goes up by ``cv_increment``."""

    provider_id: str
    role: Role
    cv_increment: int = 1


@dataclass(frozen=True)
class Outcome:
    status: Status
    needs_tiebreak: bool = False
    credits: tuple[Credit, ...] = ()
    penalties: tuple[Penalty, ...] = ()
    refund_client: bool = False          # the client gets the primary job's charge back
    deliver_from: str | None = None      # provider whose output the client should now get
    comparisons: dict[str, dict[str, Any]] = field(default_factory=dict)
    note: str = ""


def _check_distinct(*parties: Party) -> None:
    operators = [p.operator_id for p in parties]
    if len(set(operators)) != len(operators):
        raise ValueError(f"a check must run on another operator's provider; operators "
                         f"{operators} repeat")


def _penalty(party: Party, policy: PenaltyPolicy) -> Penalty:
    return Penalty(provider_id=party.provider_id, role=party.role,
                   forfeit_micro=party.job_credits_micro,
                   slash_micro=int(party.stake_micro * policy.slash_fraction),
                   claw_back_micro=party.unvested_micro if policy.claw_back_unvested else 0,
                   reset_cv=True, quota_factor=policy.quota_factor)


def resolve_pair(primary: Party, checker: Party, comparison: Comparison) -> Outcome:
    """After the first check: agreement verifies; anything else goes to a third provider."""
    _check_distinct(primary, checker)
    figures = {"primary~checker": comparison.figures()}
    if comparison.verdict == Verdict.MATCH:
        return Outcome(Status.VERIFIED, credits=(Credit(primary.provider_id, primary.role),
                                                 Credit(checker.provider_id, checker.role)),
                       comparisons=figures, note="the check agrees")
    return Outcome(Status.DISPUTED, needs_tiebreak=True, comparisons=figures,
                   note=f"the check says {comparison.verdict.value}: a third provider decides")


def resolve_three(primary: Party, checker: Party, tiebreaker: Party, *,
                  primary_checker: Comparison, primary_tiebreaker: Comparison,
                  checker_tiebreaker: Comparison,
                  policy: PenaltyPolicy = PenaltyPolicy()) -> Outcome:
    """The 2-of-3 majority, from the three pairwise comparisons."""
    _check_distinct(primary, checker, tiebreaker)
    figures = {"primary~checker": primary_checker.figures(),
               "primary~tiebreaker": primary_tiebreaker.figures(),
               "checker~tiebreaker": checker_tiebreaker.figures()}
    pairs = {(0, 1): primary_checker, (0, 2): primary_tiebreaker, (1, 2): checker_tiebreaker}
    parties = (primary, checker, tiebreaker)
    matched = [pair for pair, cmp in pairs.items() if cmp.verdict == Verdict.MATCH]
    if len(matched) >= 2:
        # Every run agrees with at least one other (a grey pair bridged by the third run):
        # nobody was outvoted.
        return Outcome(Status.VERIFIED, credits=_confirm(*parties), comparisons=figures,
                       note="all three runs agree within the thresholds")
    if not matched:
        return Outcome(Status.NONDETERMINISTIC, refund_client=True, comparisons=figures,
                       note="no two runs agree: the job is nondeterministic; the client is "
                            "refunded and nobody is slashed")
    a, b = matched[0]
    loser_index = ({0, 1, 2} - {a, b}).pop()
    loser = parties[loser_index]
    against = [cmp for pair, cmp in pairs.items() if loser_index in pair]
    if all(cmp.verdict == Verdict.MISMATCH for cmp in against):
        penalty = _penalty(loser, policy)
        how = "outvoted 2 to 1"
    else:
        # Outvoted, but at least one comparison was only grey: it loses the job's credits
        # and its run of valid checks, never stake, unvested credits or quota.
        penalty = Penalty(loser.provider_id, loser.role, forfeit_micro=loser.job_credits_micro,
                          slash_micro=0, claw_back_micro=0, reset_cv=True, quota_factor=1.0,
                          clear=False)
        how = "outvoted 2 to 1 on a grey-zone comparison (no slash)"
    winners = _confirm(parties[a], parties[b])
    if loser is primary:
        return Outcome(Status.OVERTURNED, credits=winners, penalties=(penalty,),
                       refund_client=True, deliver_from=checker.provider_id,
                       comparisons=figures,
                       note=f"the primary was {how}; the client gets the majority's output "
                            f"and its money back")
    return Outcome(Status.VERIFIED, credits=winners, penalties=(penalty,), comparisons=figures,
                   note=f"the {loser.role.value} was {how}")


def _confirm(*parties: Party) -> tuple[Credit, ...]:
    return tuple(Credit(p.provider_id, p.role) for p in parties)
