"""The score, eligibility, the critical price and the random tie-break: the pieces both the
fast clearing path and the reference implementation share, so they cannot drift apart.

Score (micro-credits, lower wins) of an ask at price ``a`` for a job of ``W`` work units::

    score = a·W + λ·(queue_s + cold_start_s + W/θ) + (1 − reliability)·F
          = W·u + v,   u = a + λ/θ,   v = λ·(queue_s + cold_start_s) + (1 − reliability)·F

It is computed in exactly that ``W·u + v`` form everywhere (scores, index thresholds,
critical prices), so floating-point rounding is the same on every path and the score is
monotone in the ask.
"""
from __future__ import annotations

import functools
import hashlib
import math
from fractions import Fraction
from collections.abc import Callable, Sequence
from typing import TypeVar

from .model import Ask, AuctionRules, JobSpec

T = TypeVar("T")

# Reasons an ask cannot take a job, in the order they are checked (the first one counts).
OFFLINE = "offline"
BUSY = "busy"
EXPIRED = "ask expired"
LINKED = "linked to the client"
EXCLUDED = "excluded from this job"
LOW_VRAM = "not enough VRAM"
NO_THROUGHPUT = "no measured throughput"
LOW_REPUTATION = "reputation below the floor"
ABOVE_RESERVE = "above the reserve"
# Client terms: the ask is eligible but cannot meet this client's max price or deadline.
ABOVE_MAX_PRICE = "above the max price"
TOO_SLOW = "cannot meet the deadline"
TERMS_REASONS = frozenset({ABOVE_MAX_PRICE, TOO_SLOW})


def effective_throughput(ask: Ask, rules: AuctionRules) -> float:
    """θ the score uses: the broker-measured figure, or a claim discounted by the rules."""
    if ask.throughput_measured:
        return float(ask.throughput_units_per_s)
    return float(ask.throughput_units_per_s) * rules.claimed_throughput_factor


def is_active(ask: Ask, rules: AuctionRules) -> bool:
    """Could this ask take any job at all right now (before job-specific checks)?"""
    return ask.online and ask.slots_free > 0 and effective_throughput(ask, rules) > 0


def score_parts(ask: Ask, lam: float, penalty: float, theta: float) -> tuple[float, float]:
    """(u, v) of the module docstring: per-unit and fixed parts of the score."""
    return (ask.price_micro_per_unit + lam / theta,
            lam * (ask.queue_s + ask.cold_start_s) + (1.0 - ask.reliability) * penalty)


def completion_s(ask: Ask, work_units: float, theta: float) -> float:
    """Expected completion time: wait, cold start, then W/θ."""
    return ask.queue_s + ask.cold_start_s + work_units / theta


def effective_reserve(job: JobSpec) -> int:
    """The admin reserve, lowered so that n slots at that price fit the client's max price."""
    if job.max_price_micro is None:
        return job.reserve_micro_per_unit
    # Exact arithmetic on the decimal form of W: 2,200 micro over 2.2 units is 1,000 per
    # unit, not the 999 that float division (999.9999…) floors to. W = num/den exactly, so
    # floor(max / (n·W)) is the integer division below.
    num, den = _decimal_ratio(float(job.work_units))
    per_unit = job.max_price_micro * den // (job.n_slots * num)
    return min(job.reserve_micro_per_unit, per_unit)


@functools.lru_cache(maxsize=4096)
def _decimal_ratio(units: float) -> tuple[int, int]:
    """The fraction the shortest decimal text of ``units`` names (``2.2`` is 11/5), as
    (numerator, denominator): parsed once per distinct value, as jobs repeat a few sizes."""
    exact = Fraction(repr(units))
    return exact.numerator, exact.denominator


def reputation_floor(job: JobSpec, rules: AuctionRules) -> float:
    """The floor that applies to ``job``: the rules', unless it gave way for this job."""
    return -math.inf if job.floor_lifted else rules.reputation_floor


def ineligibility(ask: Ask, job: JobSpec, rules: AuctionRules, now_s: float,
                  skip: frozenset[str] = frozenset()) -> str | None:
    """Why ``ask`` cannot take ``job`` (first reason, see the constants), or None.
    Reasons in ``skip`` are not checked. Assumes the ask serves the job's plugin build."""
    if not ask.online:
        return OFFLINE
    if ask.slots_free <= 0 and BUSY not in skip:
        return BUSY
    if ask.expires_at_s is not None and ask.expires_at_s <= now_s:
        return EXPIRED
    if job.client_id in ask.linked_accounts or ask.operator_id == job.client_id:
        return LINKED
    if ask.provider_id in job.excluded_provider_ids or ask.operator_id in job.excluded_operator_ids:
        return EXCLUDED
    if ask.vram_gb < job.min_vram_gb:
        return LOW_VRAM
    theta = effective_throughput(ask, rules)
    if not theta > 0:
        return NO_THROUGHPUT
    if ask.reputation < reputation_floor(job, rules) and LOW_REPUTATION not in skip:
        return LOW_REPUTATION
    if ask.price_micro_per_unit > job.reserve_micro_per_unit:
        return ABOVE_RESERVE
    if ask.price_micro_per_unit > effective_reserve(job) and ABOVE_MAX_PRICE not in skip:
        return ABOVE_MAX_PRICE
    if (job.deadline_s is not None and TOO_SLOW not in skip
            and completion_s(ask, job.work_units, theta) > job.deadline_s):
        return TOO_SLOW
    return None


def critical_ask(boundary_score: float, work_units: float, lam_over_theta: float, v: float,
                 own_ask: int) -> int:
    """The highest integer ask ``a`` whose score ``W·(a + λ/θ) + v`` is still ≤ the
    boundary (the best losing score): computed in closed form, then nudged by at most a few
    steps so it agrees exactly with the floating-point score. Never below ``own_ask`` (the
    winner's score is ≤ the boundary by construction)."""
    w = work_units
    guess = (boundary_score - v) / w - lam_over_theta
    if not math.isfinite(guess):
        return own_ask
    a = max(own_ask, math.floor(guess))
    while w * ((a + 1) + lam_over_theta) + v <= boundary_score:
        a += 1
    while a > own_ask and w * (a + lam_over_theta) + v > boundary_score:
        a -= 1
    return a


def tie_key(salt: bytes, provider_id: str) -> bytes:
    """A per-clearing random order among equal scores: one draw from the injected RNG
    (the salt) orders every tie the same way on every path."""
    return hashlib.blake2b(provider_id.encode(), key=salt, digest_size=8).digest()


def order_with_ties(items: Sequence[T], score: Callable[[T], float], pid: Callable[[T], str],
                    salt: bytes) -> list[T]:
    """``items`` sorted by score, equal scores in random (salted) order."""
    out = sorted(items, key=lambda it: (score(it), pid(it)))
    i, n = 0, len(out)
    while i < n:
        j = i + 1
        s = score(out[i])
        while j < n and score(out[j]) == s:
            j += 1
        if j - i > 1:
            out[i:j] = sorted(out[i:j], key=lambda it: tie_key(salt, pid(it)))
        i = j
    return out
