"""The re-run probability p per (provider, plugin, hardware class), DESIGN §6."""
from __future__ import annotations

import random

import pytest

from broker.verification.sampling import (SamplingPolicy, SamplingReason, Standing,
                                          check_probability, decide_check, economic_floor)

C = 1_000_000  # micro-credits per credit


def p_for(cv: int, *, stake=1_000 * C, unvested=0, gain=C, value=2 * C, q=0.99,
          policy=SamplingPolicy()):
    return check_probability(Standing(cv, stake, unvested), gain_micro=gain,
                             job_value_micro=value, catch_probability=q, policy=policy)


@pytest.mark.parametrize("cv", [0, 1, 5, 9])
def test_a_new_provider_is_always_checked(cv):
    prob = p_for(cv)
    assert (prob.p, prob.reason) == (1.0, SamplingReason.NEW_PROVIDER)


@pytest.mark.parametrize("cv", [10, 20, 40])
def test_a_reputable_provider_is_checked_one_in_cv(cv):
    prob = p_for(cv)
    assert prob.p == pytest.approx(1 / cv)
    assert prob.reason == SamplingReason.REPUTATION


@pytest.mark.parametrize("cv", [50, 100, 10_000])
def test_however_long_the_record_a_full_time_cheat_is_caught_within_200_jobs(cv):
    """Issue #20: at 1/CV a provider with CV 100 cheating on every job from then on went
    unchecked for 200 jobs 13 % of the time; the detection floor makes that 1 %."""
    q = 0.99
    prob = p_for(cv, q=q)
    assert prob.reason == SamplingReason.DETECTION_FLOOR
    assert 1 - (1 - prob.p * q) ** 200 == pytest.approx(0.99, abs=1e-3)
    assert prob.p < 0.05  # the redundancy a reputable provider costs stays within 5 %
    assert p_for(cv, policy=SamplingPolicy(detect_within_jobs=0)).p < prob.p  # no floor


def test_the_new_provider_window_is_admin_set():
    assert p_for(10, policy=SamplingPolicy(new_provider_checks=20)).p == 1.0
    assert p_for(20, policy=SamplingPolicy(new_provider_checks=20)).p == pytest.approx(1 / 20)


def test_economic_floor_formula():
    # g / (q (S + g)): gain 1, catch 0.5, at risk 9 -> 1 / (0.5 * 10) = 0.2
    assert economic_floor(C, 0.5, 9 * C) == pytest.approx(0.2)
    assert economic_floor(C, 0.0, 9 * C) == 1.0       # checks catch nothing: check everything
    assert economic_floor(C, 1.0, 0) == 1.0           # nothing at risk
    assert economic_floor(0, 0.5, 9 * C) == 0.0       # nothing to gain


def test_p_never_drops_below_the_economic_floor():
    # CV 100 would give 1%, but with 9 credits at risk and q = 0.5 cheating pays below 20%
    prob = p_for(100, stake=5 * C, unvested=4 * C, gain=C, q=0.5)
    assert prob.p == pytest.approx(0.2)
    assert prob.reason == SamplingReason.ECONOMIC_FLOOR
    # at that p a cheat's expected loss equals its gain
    assert prob.p * 0.5 * (9 * C + C) == pytest.approx(C)


def test_unvested_credits_count_as_at_risk():
    staked_only = p_for(100, stake=4 * C, unvested=0, q=0.5)
    with_unvested = p_for(100, stake=4 * C, unvested=95 * C, q=0.5)
    assert with_unvested.p < staked_only.p


def test_an_unmeasured_catch_probability_checks_everything():
    prob = check_probability(Standing(100, 1_000 * C, 0), gain_micro=C, job_value_micro=C,
                             catch_probability=None)
    assert (prob.p, prob.reason) == (1.0, SamplingReason.NO_CATCH_ESTIMATE)


def test_high_value_jobs_are_always_checked():
    policy = SamplingPolicy(always_check_above_micro=50 * C, detect_within_jobs=0)
    assert p_for(500, value=50 * C, policy=policy).p == pytest.approx(1 / 500)
    prob = p_for(500, value=50 * C + 1, policy=policy)
    assert (prob.p, prob.reason) == (1.0, SamplingReason.HIGH_VALUE)


def test_the_draw_uses_the_injected_random_and_matches_p():
    standing = Standing(20, 1_000 * C, 0)
    rng = random.Random(7)
    decisions = [decide_check(standing, rng, gain_micro=C, job_value_micro=C,
                              catch_probability=0.99) for _ in range(20_000)]
    rate = sum(d.check for d in decisions) / len(decisions)
    assert rate == pytest.approx(1 / 20, abs=0.006)
    replay = random.Random(7)
    again = [decide_check(standing, replay, gain_micro=C, job_value_micro=C,
                          catch_probability=0.99) for _ in range(20_000)]
    assert [d.check for d in again] == [d.check for d in decisions]
    assert all(d.check == (d.draw < d.p) for d in decisions)


def test_a_new_provider_is_checked_on_every_draw():
    rng = random.Random(1)
    assert all(decide_check(Standing(3, 0, 0), rng, gain_micro=C, job_value_micro=C,
                            catch_probability=0.9).check for _ in range(1_000))


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_standing_refuses_bad_counts(bad):
    with pytest.raises(ValueError, match="consecutive_valid"):
        Standing(bad, 0, 0)


def test_catch_probability_must_be_a_probability():
    with pytest.raises(ValueError, match="catch_probability"):
        economic_floor(C, 1.2, C)
