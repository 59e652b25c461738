"""2-of-3 majority resolution (DESIGN §6) as a table of pairwise verdicts."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from broker.verification.comparators import Verdict
from broker.verification.outcomes import (Party, PenaltyPolicy, Role, Status, resolve_pair,
                                          resolve_three)

C = 1_000_000
M, X, G = Verdict.MATCH, Verdict.MISMATCH, Verdict.TIEBREAK


@dataclass(frozen=True)
class Figures:
    verdict: Verdict
    ssim: float = 0.5

    def figures(self):
        return {"verdict": self.verdict.value, "ssim": self.ssim}


P = Party("prov-a", "op-1", Role.PRIMARY, "rcpt-a", stake_micro=100 * C, unvested_micro=7 * C,
          job_credits_micro=2 * C)
K = Party("prov-b", "op-2", Role.CHECKER, "rcpt-b", stake_micro=50 * C, unvested_micro=3 * C,
          job_credits_micro=2 * C)
T = Party("prov-c", "op-3", Role.TIEBREAKER, "rcpt-c", stake_micro=80 * C,
          job_credits_micro=2 * C)


def three(pc, pt, ct, policy=PenaltyPolicy()):
    return resolve_three(P, K, T, primary_checker=Figures(pc), primary_tiebreaker=Figures(pt),
                         checker_tiebreaker=Figures(ct), policy=policy)


def test_agreement_verifies_and_raises_both_cvs():
    out = resolve_pair(P, K, Figures(M))
    assert out.status == Status.VERIFIED and not out.needs_tiebreak
    assert {(c.provider_id, c.cv_increment) for c in out.credits} == {("prov-a", 1),
                                                                       ("prov-b", 1)}
    assert out.penalties == () and not out.refund_client
    assert out.comparisons["primary~checker"]["ssim"] == 0.5


@pytest.mark.parametrize("verdict", [X, G])
def test_disagreement_or_grey_brings_a_third_provider(verdict):
    out = resolve_pair(P, K, Figures(verdict))
    assert out.status == Status.DISPUTED and out.needs_tiebreak
    assert out.penalties == () and out.credits == ()


# pc, pt, ct -> status, loser, slashed
TABLE = [
    ((X, M, X), Status.VERIFIED, "prov-b", True),      # outvoted checker
    ((X, X, M), Status.OVERTURNED, "prov-a", True),    # outvoted primary
    ((X, X, X), Status.NONDETERMINISTIC, None, False),
    ((G, G, G), Status.NONDETERMINISTIC, None, False),
    ((G, M, M), Status.VERIFIED, None, False),         # a grey pair bridged by the third
    ((X, M, M), Status.VERIFIED, None, False),
    ((M, X, X), Status.VERIFIED, "prov-c", True),      # an outvoted tiebreaker, the same
    ((G, M, G), Status.VERIFIED, "prov-b", False),     # outvoted on grey only: no slash
    ((X, G, M), Status.OVERTURNED, "prov-a", False),
]


@pytest.mark.parametrize(("verdicts", "status", "loser", "slashed"), TABLE)
def test_two_of_three(verdicts, status, loser, slashed):
    out = three(*verdicts)
    assert out.status == status
    assert [p.provider_id for p in out.penalties] == ([loser] if loser else [])
    winners = {c.provider_id for c in out.credits}
    if status == Status.NONDETERMINISTIC:
        assert winners == set() and out.refund_client
    elif loser:
        assert winners == {"prov-a", "prov-b", "prov-c"} - {loser}
    else:
        assert winners == {"prov-a", "prov-b", "prov-c"}
    if loser:
        (penalty,) = out.penalties
        assert penalty.reset_cv
        assert penalty.forfeit_micro == 2 * C
        assert (penalty.slash_micro > 0) == slashed
        assert (penalty.claw_back_micro > 0) == (slashed and loser != "prov-c")
        assert (penalty.quota_factor < 1.0) == slashed
    assert set(out.comparisons) == {"primary~checker", "primary~tiebreaker",
                                    "checker~tiebreaker"}


def test_a_losing_primary_is_overturned_refunded_and_replaced():
    out = three(X, X, M)
    assert out.refund_client and out.deliver_from == "prov-b"
    (penalty,) = out.penalties
    assert penalty.role == Role.PRIMARY
    assert penalty.slash_micro == 10 * C       # 10% of 100 credits of stake
    assert penalty.claw_back_micro == 7 * C    # all unvested credits
    assert penalty.quota_factor == 0.5


def test_an_outvoted_checker_is_treated_like_a_cheating_primary():
    out = three(X, M, X)
    assert not out.refund_client and out.deliver_from is None
    (penalty,) = out.penalties
    assert (penalty.role, penalty.slash_micro, penalty.claw_back_micro) == (
        Role.CHECKER, 5 * C, 3 * C)


def test_the_penalty_policy_is_admin_set():
    out = three(X, X, M, policy=PenaltyPolicy(slash_fraction=0.5, quota_factor=0.25,
                                              claw_back_unvested=False))
    (penalty,) = out.penalties
    assert (penalty.slash_micro, penalty.claw_back_micro, penalty.quota_factor) == (
        50 * C, 0, 0.25)


def test_nobody_is_slashed_when_all_three_disagree():
    out = three(X, X, X)
    assert out.refund_client and out.penalties == () and out.credits == ()


def test_checks_must_run_on_other_operators():
    same_operator = Party("prov-z", "op-1", Role.CHECKER, "rcpt-z")
    with pytest.raises(ValueError, match="another operator"):
        resolve_pair(P, same_operator, Figures(M))
