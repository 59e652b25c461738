"""The obvious implementation of clearing: scan every ask in the book, check eligibility
with :func:`scoring.ineligibility`, score, sort. Slow on purpose and easy to read; it is
the oracle the tests hold the fast path to, and the baseline of ``bench/auction.py``."""
from __future__ import annotations

import random

from . import scoring
from .book import OrderBook
from .clearing import Candidate, allocate, draw_salt, run
from .model import ClearingResult, JobSpec


def _clear_scan(job: JobSpec, book: OrderBook, salt: bytes, now_s: float) -> ClearingResult | None:
    rules = book.rules
    lam = rules.lambda_for(job.priority)
    penalty = rules.failure_penalty_micro if job.failure_penalty_micro is None \
        else job.failure_penalty_micro
    w = float(job.work_units)
    cands: list[Candidate] = []
    for ask in book:
        if ask.build_key != job.build_key or scoring.ineligibility(ask, job, rules, now_s):
            continue
        theta = scoring.effective_throughput(ask, rules)
        u, v = scoring.score_parts(ask, lam, penalty, theta)
        cands.append((w * u + v, ask.provider_id, ask,
                      scoring.completion_s(ask, w, theta), lam / theta, v))
    cands.sort(key=lambda c: c[0])  # the full sort the fast path avoids
    if not cands:
        return None
    return allocate(job, cands, salt, now_s)


def reference_clear(job: JobSpec, book: OrderBook, rng: random.Random,
                    now_s: float) -> ClearingResult:
    """Same contract and same result as :func:`clearing.clear`, by full scan."""
    return run(job, book, draw_salt(rng), now_s, _clear_scan)
