"""How often a provider's jobs are re-run on a second provider (DESIGN §6).

The probability ``p`` is kept per (provider, plugin, hardware class), the unit a record of
honest work is earned in (a provider honest on one plugin or GPU can cheat on another):

* ``1`` while the provider is new: fewer than ``new_provider_checks`` consecutive valid
  checks (CV);
* then BOINC-style ``1 / CV``;
* never below the economic bound ``p >= g / (q * (S + g))``: cheating one job gains ``g``,
  a check catches it with probability ``q`` and then costs the provider ``S`` (stake plus
  unvested credits, which are clawed back) as well as ``g``, so cheating pays only while
  ``p * q * (S + g) < g``;
* never below the **detection floor** ``1 − (1 − c)^(1/N) / q``: a provider that cheats on
  every job from now on is caught with probability ``c`` (0.99) within ``N`` (200) of its
  jobs, however long its honest record (issue #20; 2.3 % at q = 1: the steady-state
  redundancy of a reputable provider, within the 5 % budget);
* ``1`` for any job worth more than the admin-set ``always_check_above_micro``.

Everything here is a pure function of its arguments; the random draw takes an injected
``random.Random`` so a test (or an audit replay) can reproduce it.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum


class SamplingReason(str, Enum):
    """Which rule set ``p`` (the largest one wins)."""

    NEW_PROVIDER = "new_provider"
    HIGH_VALUE = "high_value"
    NO_CATCH_ESTIMATE = "no_catch_estimate"
    ECONOMIC_FLOOR = "economic_floor"
    DETECTION_FLOOR = "detection_floor"  # caught within N jobs with confidence c
    REPUTATION = "reputation"  # 1 / CV


@dataclass(frozen=True)
class SamplingKey:
    """The unit a record of valid checks is kept for."""

    provider_id: str
    plugin: str
    hardware_class: str


@dataclass(frozen=True)
class Standing:
    """What the broker knows about one provider for one ``SamplingKey``."""

    consecutive_valid: int  # CV: checks passed in a row since the last failure
    stake_micro: int        # staked credits that a lost dispute can slash
    unvested_micro: int     # earned credits still inside the vesting window (claw-back)

    def __post_init__(self) -> None:
        for name in ("consecutive_valid", "stake_micro", "unvested_micro"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")

    @property
    def at_risk_micro(self) -> int:
        """S: what a caught cheat loses on top of the job's credits."""
        return self.stake_micro + self.unvested_micro


@dataclass(frozen=True)
class SamplingPolicy:
    """Admin-set knobs. ``always_check_above_micro=None`` turns the high-value rule off."""

    new_provider_checks: int = 10
    always_check_above_micro: int | None = None
    # A cheater cheating on every job is caught with probability detect_confidence within
    # detect_within_jobs jobs (0 jobs: no detection floor).
    detect_within_jobs: int = 200
    detect_confidence: float = 0.99

    def __post_init__(self) -> None:
        if self.detect_within_jobs < 0 or not 0.0 <= self.detect_confidence < 1.0:
            raise ValueError("detect_within_jobs must be >= 0 and detect_confidence within "
                             f"[0, 1), got {self.detect_within_jobs}, {self.detect_confidence}")
        if self.new_provider_checks < 1:
            raise ValueError(f"new_provider_checks must be >= 1, got {self.new_provider_checks}")
        if self.always_check_above_micro is not None and self.always_check_above_micro < 0:
            raise ValueError("always_check_above_micro must be >= 0 or None, "
                             f"got {self.always_check_above_micro}")


@dataclass(frozen=True)
class CheckProbability:
    p: float
    reason: SamplingReason
    economic_floor: float  # the bound, reported even when another rule set p


@dataclass(frozen=True)
class CheckDecision:
    check: bool
    p: float
    reason: SamplingReason
    economic_floor: float
    draw: float  # the uniform draw compared with p (kept for the audit log)


def economic_floor(gain_micro: int, catch_probability: float, at_risk_micro: int) -> float:
    """``g / (q * (S + g))`` clamped to [0, 1]; 1 when a check cannot catch anything."""
    if gain_micro < 0 or at_risk_micro < 0:
        raise ValueError(f"gain_micro and at_risk_micro must be >= 0, got {gain_micro}, "
                         f"{at_risk_micro}")
    if not 0.0 <= catch_probability <= 1.0:
        raise ValueError(f"catch_probability must be within [0, 1], got {catch_probability}")
    if gain_micro == 0:
        return 0.0  # nothing to gain by cheating
    if catch_probability == 0.0:
        return 1.0
    return min(1.0, gain_micro / (catch_probability * (at_risk_micro + gain_micro)))


def detection_floor(catch_probability: float, within_jobs: int, confidence: float) -> float:
    """The p at which a provider cheating on every job is caught (a check that catches
    with probability ``q``) with probability ``confidence`` within ``within_jobs`` jobs:
    ``1 − (1 − confidence)^(1/N)``, divided by q; 0 with no such target."""
    if within_jobs <= 0 or confidence <= 0.0:
        return 0.0
    if catch_probability <= 0.0:
        return 1.0
    return min(1.0, (1.0 - (1.0 - confidence) ** (1.0 / within_jobs)) / catch_probability)


def check_probability(standing: Standing, *, gain_micro: int, job_value_micro: int,
                      catch_probability: float | None,
                      policy: SamplingPolicy = SamplingPolicy()) -> CheckProbability:
    """The probability that this job is re-run on a second provider.

    ``gain_micro`` is g, what the provider is paid for the job (what it keeps by returning
    anything without computing); ``job_value_micro`` is what the client pays, compared with
    the high-value limit; ``catch_probability`` is q, measured per plugin by the canaries and
    the cheater simulations (None while unmeasured, which checks everything).
    """
    if catch_probability is None:
        floor = 1.0
    else:
        floor = economic_floor(gain_micro, catch_probability, standing.at_risk_micro)
    high = policy.always_check_above_micro
    if high is not None and job_value_micro > high:
        return CheckProbability(1.0, SamplingReason.HIGH_VALUE, floor)
    if standing.consecutive_valid < policy.new_provider_checks:
        return CheckProbability(1.0, SamplingReason.NEW_PROVIDER, floor)
    if catch_probability is None:
        return CheckProbability(1.0, SamplingReason.NO_CATCH_ESTIMATE, floor)
    reputation = 1.0 / standing.consecutive_valid
    detect = detection_floor(catch_probability, policy.detect_within_jobs,
                             policy.detect_confidence)
    if floor > reputation and floor >= detect:
        return CheckProbability(floor, SamplingReason.ECONOMIC_FLOOR, floor)
    if detect > reputation:
        return CheckProbability(detect, SamplingReason.DETECTION_FLOOR, floor)
    return CheckProbability(reputation, SamplingReason.REPUTATION, floor)


def decide_check(standing: Standing, rng: random.Random, *, gain_micro: int,
                 job_value_micro: int, catch_probability: float | None,
                 policy: SamplingPolicy = SamplingPolicy()) -> CheckDecision:
    """Draw whether to check this job. Call it only after the first provider has signed
    its receipt, so nothing the provider sees can depend on the outcome."""
    prob = check_probability(standing, gain_micro=gain_micro, job_value_micro=job_value_micro,
                             catch_probability=catch_probability, policy=policy)
    draw = rng.random()  # always draw, so the stream of draws does not depend on p
    return CheckDecision(check=draw < prob.p, p=prob.p, reason=prob.reason,
                         economic_floor=prob.economic_floor, draw=draw)
