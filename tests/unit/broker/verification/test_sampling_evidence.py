"""Sampled-text evidence compounded across a provider's checks (issue #20,
``sampled_text.SamplingState``): one check of a claim sampled from a narrower nucleus than
asked reaches only the grey zone, so the checks of one provider compound. The mixture over
start points is a test supermartingale under honest sampling: Ville's bound holds across
checks, a cheater crosses within a few, and honest checks banked beforehand do not buy
a cheater room."""
from __future__ import annotations

import math
import random

import pytest

from broker.verification.comparators import Rescore, TextClaim, TokenScore, Verdict, compare_text
from broker.verification.sampled_text import (Position, SamplingBounds, SamplingState,
                                              sampling_evidence)

REJECT = -math.log(SamplingBounds().reject)  # 20.7 nats


def _positions(rng: random.Random, n: int, draw) -> list[Position]:
    """n positions of random 12-token distributions (nucleus: all); ``draw`` picks the
    claimed token from the probabilities sorted in descending order."""
    out = []
    for _ in range(n):
        w = sorted((rng.expovariate(1.0) ** 3 for _ in range(12)), reverse=True)
        p = [x / sum(w) for x in w]
        k = draw(p)
        out.append(Position(lp=math.log(p[k]), mass_above=sum(p[:k]), mass_tied=p[k],
                            top_mass=p[0], nucleus_mass=1.0,
                            tilts=tuple((g, math.log(sum(x ** g for x in p)))
                                        for g in (0.6, 1.5, 3.0))))
    return out


def _honest(rng):
    return lambda p: rng.choices(range(len(p)), weights=p)[0]


def _narrow(rng, top_p=0.5):
    """Sampled from the smallest set of likeliest tokens holding ``top_p`` of the mass."""
    def draw(p):
        keep, mass = 0, 0.0
        while mass < top_p:
            mass += p[keep]
            keep += 1
        return rng.choices(range(keep), weights=p[:keep])[0]
    return draw


def test_the_state_starts_at_one_and_compounds_by_the_mixture_recursion():
    s = SamplingState()
    assert s.log_m == 0.0  # M_0 = 1: no evidence
    s1 = s.after(math.log(4.0))
    # S_1 = e_1 · w_1 = 4 · 1/2; M_1 = S_1 + 1/2
    assert s1.checks == 1 and math.isclose(math.exp(s1.log_m), 2.5)
    s2 = s1.after(math.log(3.0))
    # S_2 = 3 · (2 + 1/6) = 6.5; M_2 = 6.5 + 1/3
    assert math.isclose(math.exp(s2.log_m), 6.5 + 1 / 3)
    with pytest.raises(ValueError, match="NaN"):
        s.after(float("nan"))
    with pytest.raises(ValueError):
        SamplingState(checks=-1)


def test_e_values_of_one_keep_the_evidence_at_one():
    s = SamplingState()
    for _ in range(50):
        s = s.after(0.0)
        assert math.isclose(s.log_m, 0.0, abs_tol=1e-12)


def test_two_grey_checks_compound_past_the_reject_bound():
    """e^13 twice (the grey zone each time: doubt at e^9.2, reject at e^20.7)."""
    s = SamplingState().after(13.0)
    assert not s.crossed(SamplingBounds())
    assert s.after(13.0).crossed(SamplingBounds())


def test_honest_checks_banked_first_cost_a_late_cheater_only_its_start_weight():
    """A plain product would carry the honest checks' e-values below 1 forward; the mixture
    restarts at every check at weight 1/(k(k+1))."""
    s = SamplingState()
    for _ in range(1000):
        s = s.after(-2.0)  # a thousand honest checks, each e^-2
    late = 0
    while not s.crossed(SamplingBounds()):
        s = s.after(13.0)
        late += 1
    # log(1000·1001) ≈ 13.8 nats for starting late: 3 grey checks instead of 2
    assert late == 3
    plain = -2.0 * 1000
    assert plain + 13.0 * late < REJECT  # the plain product would still be far below


def test_honest_providers_cross_no_more_often_than_alpha_across_their_checks():
    """Ville's inequality over whole check histories: 300 honest providers, 30 checks each,
    against a bound of α = 5 % (to see it at all): the share whose compounded evidence ever
    crosses stays below α. (A single check's own bound is α per check: over 30 checks
    the union is up to 30 α, which is why the single-check bound stays at 1e-9.)"""
    rng = random.Random(3)
    bounds = SamplingBounds(reject=0.05, doubt=0.05)
    crossed = 0
    for provider in range(300):
        s = SamplingState()
        for check in range(30):
            ev = sampling_evidence(_positions(rng, rng.choice([5, 20]), _honest(rng)),
                                   f"{provider}/{check}".encode(), bounds, prior=s)
            s = s.after(ev.log_e)
            if s.crossed(bounds):
                crossed += 1
                break
    assert crossed / 300 <= 0.05


def test_a_narrow_nucleus_claim_rejected_over_checks_but_not_in_one():
    rng = random.Random(5)
    s = SamplingState()
    first = None
    verdicts = []
    for check in range(30):
        ev = sampling_evidence(_positions(rng, 12, _narrow(rng)), f"n/{check}".encode(),
                               prior=s)
        verdicts.append(ev.verdict)
        if ev.verdict == "reject":
            first = check
            # the reject comes from the checks compounded, not from this one
            assert ev.compounded.log_m > ev.log_e and ev.log_e < REJECT
            assert "compounded over its last" in ev.reason
            break
        s = s.after(ev.log_e)
    assert first is not None and first >= 1, verdicts
    assert ev.figures()["compounded"]["checks"] == first + 1


def test_compare_text_rejects_on_the_compounded_evidence():
    """The comparator's verdict with the provider's prior: a clear mismatch (the third run
    decides, as for a single-check reject); without it, grey at most."""
    rng = random.Random(9)
    positions = _positions(rng, 30, _narrow(rng))
    tokens = tuple(TokenScore(logprob=p.lp, rank=0, top_logprob=p.lp, mass_above=p.mass_above,
                              eos_logprob=-50.0, eos_mass_sampled=0.0, position=p)
                   for p in positions)
    claim = TextClaim(token_ids=list(range(100, 130)), logprobs=[p.lp for p in positions],
                      finish_reason="length", max_new_tokens=30, temperature=1.0, top_p=1.0)
    rescore = Rescore(tokens=tokens, eos_ids=frozenset({2}), temperature=1.0, top_p=1.0)
    alone = compare_text(claim, rescore, salt=b"s")
    assert alone.verdict is not Verdict.MISMATCH
    prior = SamplingState().after(REJECT - 1.0)
    assert alone.sampling is not None and alone.sampling.log_e > 2.0
    with_prior = compare_text(claim, rescore, salt=b"s", prior=prior)
    assert with_prior.verdict is Verdict.MISMATCH, with_prior.reasons
    assert with_prior.figures()["sampling"]["compounded"]["checks"] == 2
