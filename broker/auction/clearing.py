"""Clearing a job against the standing asks: who wins, and what each winner is paid.

Rule (DESIGN §4). Among eligible asks, the lowest score wins. All machines of one operator
bid as one: the operator's bid is its best-scoring machine, and only operators compete
with each other. For a job of K slots (a split batch; K = 1 for an ordinary job) the K best
operators win, each on its best machine. Each winner is paid its **critical ask**: the
highest ask at which it would still rank among the K best, i.e. the ask that would make
its score equal to the best *losing* operator's score (the (K+1)-th), capped by the
reserve. When no operator loses (fewer than K+1 eligible), the winners are paid the
reserve; if there are fewer operators than slots, the remaining slots go to the winners'
other machines, then to further free slots on the same machines, also at the reserve, and
whatever cannot be placed is reported as unfilled. Ties are broken by a random order drawn
once per clearing from the injected ``random.Random``. The reputation floor has one
exception: it gives way for a job that no ask at or above it could take
(:func:`floor_gives_way`).

Why asking one's true cost is the best strategy. A winner's payment depends only on the
*other* operators' scores: its own ask decides whether it wins, never how much it gets.
Let c be the true cost per unit and p the critical ask. Asking c wins exactly when c ≤ p
(with a fair coin at equality) and then earns (p − c)·W ≥ 0. Asking more than c can only
turn some wins into losses, each of which was worth ≥ 0. Asking less than c can only add
wins where p < c, each worth (p − c)·W < 0. So no other ask ever does better than c,
whatever the others do. The reserve cap keeps this: p = min(reserve, critical), still
independent of one's own ask, and asks above the reserve are not eligible. Operator
grouping is what makes a sibling machine unable to set a winner's price; the one limit it
leaves (the reserve caps price per unit, not score) is described in the package docstring.

``clear`` is the fast path (threshold algorithm over the book's sorted views); the
package's ``reference_clear`` is the obvious full scan. Both hand their candidates to the
same ``allocate`` so they give the same result for the same RNG state.
"""
from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from . import scoring
from .book import OrderBook
from .errors import CannotMeetTerms, NoEligibleProvider
from .model import Ask, Award, ClearingResult, JobSpec

# A candidate: (score, provider_id, ask, expected completion s, λ/θ, v)
Candidate = tuple[float, str, Ask, float, float, float]

_TA_STEP = 8  # rows read from each sorted list between two stopping checks


def _penalty(job: JobSpec, book: OrderBook) -> int:
    return book.rules.failure_penalty_micro if job.failure_penalty_micro is None \
        else job.failure_penalty_micro


def draw_salt(rng: random.Random) -> bytes:
    """One draw per clearing orders all ties (see :func:`scoring.tie_key`)."""
    return rng.getrandbits(64).to_bytes(8, "big")


def clear(job: JobSpec, book: OrderBook, rng: random.Random, now_s: float) -> ClearingResult:
    """Clear ``job`` against ``book`` at time ``now_s`` (epoch seconds; only used to skip
    expired asks and stamp the result). Does not change the book: the broker marks the
    winners' slots busy (``book.update_provider``) when it assigns the job.

    Raises :class:`NoEligibleProvider` when no ask is eligible at all, and
    :class:`CannotMeetTerms` when eligible asks exist but none meets the client's max price
    or deadline; both carry the reason counts and the best achievable terms."""
    return run(job, book, draw_salt(rng), now_s, _clear_fast)


def run(job: JobSpec, book: OrderBook, salt: bytes, now_s: float,
        clear_fn: ClearFn) -> ClearingResult:
    """Clearing with the reputation floor's one exception, shared by the fast path and
    the reference: when nothing clears and the floor :func:`gives way <floor_gives_way>`,
    clear again with it lifted."""
    result = clear_fn(job, book, salt, now_s)
    if result is None and floor_gives_way(job, book, now_s):
        job = replace(job, floor_lifted=True)
        result = clear_fn(job, book, salt, now_s)
    if result is None:
        raise refusal(job, book, salt, now_s, clear_fn)
    return result


def floor_gives_way(job: JobSpec, book: OrderBook, now_s: float) -> bool:
    """The reputation floor keeps asks under it out of a job only while some ask at or above
    it could take the job, busy or not, whatever the client's max price and deadline: such
    a job waits for a reliable provider. When every ask that could take it is under the
    floor (a thin market, a build only shaky machines serve), waiting would last until
    canaries restore someone, so the floor gives way and those asks compete as usual (the
    score still charges them ``(1 − reliability)·F``). Whether it gives way never depends
    on the ask of a provider that could win, so truthful asking stays dominant."""
    if job.floor_lifted:
        return False
    bucket = book.bucket(job.build_key)
    if bucket is None:
        return False
    rules = book.rules
    floor = rules.reputation_floor
    skip = _FLOOR_SKIP
    under = False
    for ask in bucket.asks.values():
        if scoring.ineligibility(ask, job, rules, now_s, skip) is None:
            if ask.reputation >= floor:
                return False
            under = True
    return under


_FLOOR_SKIP = frozenset({scoring.BUSY, scoring.LOW_REPUTATION, scoring.ABOVE_MAX_PRICE,
                         scoring.TOO_SLOW})


def _clear_fast(job: JobSpec, book: OrderBook, salt: bytes, now_s: float) -> ClearingResult | None:
    cands = _search(job, book, now_s)
    if not cands:
        return None
    return allocate(job, cands, salt, now_s)


def _search(job: JobSpec, book: OrderBook, now_s: float) -> list[Candidate]:
    """Threshold algorithm over the bucket's (λ, F) view (see ``book``): the eligible asks
    whose score is at most the best losing operator's score, or every eligible ask when
    fewer than K+1 operators are eligible."""
    bucket = book.bucket(job.build_key)
    if bucket is None:
        return []
    rules = book.rules
    lam = rules.lambda_for(job.priority)
    view = bucket.view(lam, _penalty(job, book))
    by_u, by_v, parts, asks = view.by_u, view.by_v, view.parts, bucket.asks
    n = len(by_u)
    w = float(job.work_units)
    need = job.n_slots + 1
    r_eff = scoring.effective_reserve(job)
    min_vram = job.min_vram_gb
    floor = scoring.reputation_floor(job, rules)
    client = job.client_id
    deadline = job.deadline_s
    measured_only = rules.claimed_throughput_factor
    ex_pids, ex_ops = job.excluded_provider_ids, job.excluded_operator_ids
    seen: set[str] = set()
    cands: list[Candidate] = []
    op_best: dict[str, float] = {}
    top: list[tuple[float, str]] = []  # the `need` best operator scores, ascending
    i = 0
    while i < n:
        end = min(i + _TA_STEP, n)
        for lst in (by_u, by_v):
            for j in range(i, end):
                pid = lst[j][1]
                if pid in seen:
                    continue
                seen.add(pid)
                a = asks[pid]
                if (a.price_micro_per_unit > r_eff or a.vram_gb < min_vram
                        or a.reputation < floor or client in a.linked_accounts
                        or a.operator_id == client
                        or (ex_pids and pid in ex_pids) or (ex_ops and a.operator_id in ex_ops)
                        or (a.expires_at_s is not None and a.expires_at_s <= now_s)):
                    continue
                theta = a.throughput_units_per_s if a.throughput_measured \
                    else a.throughput_units_per_s * measured_only
                t = a.queue_s + a.cold_start_s + w / theta
                if deadline is not None and t > deadline:
                    continue
                u, v, lot = parts[pid]
                s = w * u + v
                cands.append((s, pid, a, t, lot, v))
                op = a.operator_id
                best = op_best.get(op)
                if best is not None and s >= best:
                    continue
                op_best[op] = s
                if best is not None:
                    for k, (_, o) in enumerate(top):
                        if o == op:
                            del top[k]
                            break
                if len(top) < need or s < top[-1][0]:
                    top.append((s, op))
                    top.sort()
                    if len(top) > need:
                        top.pop()
        i = end
        if len(top) == need:
            threshold = w * by_u[i][0] + by_v[i][0] if i < n else math.inf
            if threshold > top[-1][0]:
                bound = top[-1][0]
                return [c for c in cands if c[0] <= bound]
    return cands


def allocate(job: JobSpec, cands: list[Candidate], salt: bytes, now_s: float) -> ClearingResult:
    """Winners and prices from the eligible candidates (all of those scoring at most the
    best losing operator's score must be present)."""
    k = job.n_slots
    w = job.work_units
    r_eff = scoring.effective_reserve(job)
    ordered = scoring.order_with_ties(cands, lambda c: c[0], lambda c: c[1], salt)
    reps: list[Candidate] = []      # each operator's best machine, best operator first
    others: list[Candidate] = []    # the operators' other machines, best first
    ops: set[str] = set()
    for c in ordered:
        op = c[2].operator_id
        if op in ops:
            others.append(c)
        else:
            ops.add(op)
            reps.append(c)
    boundary = reps[k][0] if len(reps) > k else None
    awards: list[Award] = []

    def award(c: Candidate, price: int, by: str) -> None:
        awards.append(Award(slot=len(awards), provider_id=c[1], operator_id=c[2].operator_id,
                            price_micro_per_unit=price, payment_micro=math.floor(price * w),
                            expected_completion_s=c[3], price_set_by=by))

    for c in reps[:k]:
        if boundary is None:
            award(c, r_eff, "reserve")
        else:
            crit = scoring.critical_ask(boundary, w, c[4], c[5], c[2].price_micro_per_unit)
            if crit >= r_eff:
                award(c, r_eff, "reserve")
            else:
                award(c, crit, "runner_up")
    if len(awards) < k:
        # Fewer operators than slots: nobody is left to compete, so the rest goes at the
        # reserve to the winners' other machines, then to further free slots on any of them.
        used = Counter(a.provider_id for a in awards)
        for c in others:
            if len(awards) == k:
                break
            if not used[c[1]]:
                used[c[1]] += 1
                award(c, r_eff, "reserve")
        progress = True
        while len(awards) < k and progress:
            progress = False
            for c in ordered:
                if len(awards) == k:
                    break
                if used[c[1]] < c[2].slots_free:
                    used[c[1]] += 1
                    award(c, r_eff, "reserve")
                    progress = True
    return ClearingResult(job_id=job.job_id, build_key=job.build_key, awards=tuple(awards),
                          unfilled_slots=k - len(awards), reserve_micro_per_unit=r_eff,
                          cleared_at_s=now_s, floor_lifted=job.floor_lifted)


ClearFn = Callable[[JobSpec, OrderBook, bytes, float], "ClearingResult | None"]


def refusal(job: JobSpec, book: OrderBook, salt: bytes, now_s: float,
            clear_fn: ClearFn) -> NoEligibleProvider | CannotMeetTerms:
    """The error for a job that cannot clear: reason counts over every ask for the plugin,
    and the best terms achievable (the clearing price with the client's max price and
    deadline lifted, and the fastest expected completion among eligible asks)."""
    rules = book.rules
    reasons: Counter[str] = Counter()
    other_builds: set[str] = set()
    serving = 0
    eligible: list[Ask] = []
    for ask in book.asks_for_plugin(job.plugin):
        if ask.build_key != job.build_key:
            other_builds.add(ask.provider_id)
            continue
        serving += 1
        why = scoring.ineligibility(ask, job, rules, now_s)
        if why is None or why in scoring.TERMS_REASONS:
            eligible.append(ask)
        if why is not None:
            reasons[why] += 1
    other_builds -= {a.provider_id for a in book.asks_for_plugin(job.plugin)
                     if a.build_key == job.build_key}
    if other_builds:
        reasons["serve another version or weights"] = len(other_builds)
    parts = [f"{serving} provider{'s' if serving != 1 else ''} serve{'s' if serving == 1 else ''} "
             f"{job.build_label}"]
    parts += [f"{n} {why}" for why, n in reasons.most_common()]
    summary = "; ".join(parts)
    if not eligible:
        return NoEligibleProvider(
            f"no provider can take this job now: {summary}. It can wait in the queue until "
            "capacity appears.", reasons=reasons)
    best_completion = min(
        scoring.completion_s(a, job.work_units, scoring.effective_throughput(a, rules))
        for a in eligible)
    lifted = clear_fn(replace(job, max_price_micro=None, deadline_s=None), book, salt, now_s)
    best_price = lifted.total_payment_micro if lifted is not None else None
    terms = []
    if job.max_price_micro is not None:
        terms.append(f"max_price_micro={job.max_price_micro:,}")
    if job.deadline_s is not None:
        terms.append(f"deadline_s={job.deadline_s:g}")
    price_text = "no price" if best_price is None else f"{best_price:,} micro-credits for the job"
    return CannotMeetTerms(
        f"no provider can meet {' and '.join(terms)}: {summary}. Best achievable: "
        f"{price_text}, or completion in {best_completion:.1f} s; "
        "raise max_price_micro or relax deadline_s.",
        reasons=reasons, best_price_micro=best_price, best_completion_s=best_completion)
