"""The auction (DESIGN §4): providers' sealed standing asks, and second-score clearing of
jobs against them. Pure domain code: stdlib only, no Flask, grpc or SQLAlchemy; transport
and storage call into it.

Economics in one page
---------------------
A provider posts a standing ask: micro-credits per work unit for one plugin build. A job of
``W`` work units clears at once against the asks that can run it (same plugin version and
weights digest, enough VRAM, a broker-measured throughput θ, reputation at or above the
floor, ask at or below the reserve, not linked to the client, online, a free slot). The
weights digest is only a bucket key here: which digest a job is pinned to, and under which
digests a provider's ask is filed, is the broker's call (``broker/market/builds.py``). The
reputation floor gives way for a job that no ask at or above it could take, busy or not
(``clearing.floor_gives_way``): a thin market then still clears, and a job waits only for
a reliable provider that exists. Each eligible ask gets a score in micro-credits, lower is
better::

    score = ask·W + λ·(queue_s + cold_start_s + W/θ) + (1 − reliability)·F

the price, plus the client's cost of waiting (λ from its priority: economy 10, standard
100, fast 1,000 micro-credits per second by default), plus the expected cost of a failure
(F, 10,000 micro by default). The score is what the job really costs the client, so the
lowest score is the best deal, not merely the lowest price: at equal asks the faster,
more reliable provider wins.

The winner is not paid its ask but its **critical ask**: the highest ask with which it
would still have won, i.e. the ask that would bring its score up to the runner-up's
(computed in closed form), capped by the reserve; a sole bidder gets the reserve. A split
job of K slots goes to the K best operators, each paid the ask that would bring it level
with the best loser (the (K+1)-th). Since what a winner is paid never depends on its own
ask, only *whether* it wins does, asking one's true cost is a dominant strategy: asking
more only loses jobs that were profitable, asking less only wins jobs that pay below cost
(the argument in full is in :mod:`.clearing`). Providers therefore need no bidding
strategy, and the broker can clear from standing asks without a round trip.

All machines of one operator bid as one: only the operator's best machine competes, so one
operator never takes two slots of a split while another is eligible, and its own machines
never set each other's price. Ties are broken in a random order drawn from the injected
``random.Random``. Results name winners and clearing prices, never asks; refusals give
counts per reason and the best achievable price and completion time.

Known limits: with several machines, an operator whose best machine would be paid the
capped reserve might prefer a slower machine being chosen (the reserve caps the price per
unit, not the score); with one machine per operator the dominance argument is exact.
Claimed (unmeasured) throughput is ineligible by default, because a claim is not a fact a
second-price rule can discipline.

Public API::

    OrderBook(rules=None)            .post(ask) .update_provider(pid, **changes) .repost(pid, asks)
                                     .withdraw(pid, plugin=None, ...) .get(pid, build_key)
    clear(job, book, rng, now_s) -> ClearingResult   (raises NoEligibleProvider / CannotMeetTerms)
    reference_clear(job, book, rng, now_s)           (full-scan oracle, same result)
"""
from .book import OrderBook
from .clearing import clear
from .errors import (AuctionError, CannotMeetTerms, InvalidAsk, InvalidJob, NoEligibleProvider,
                     NoMatch, UnknownAsk)
from .model import (DEFAULT_LAMBDA_MICRO_PER_S, MICRO_PER_CREDIT, Ask, AuctionRules, Award,
                    ClearingResult, JobSpec, Priority)
from .reference import reference_clear
from .validation import validate_ask

__all__ = [
    "Ask", "AuctionError", "AuctionRules", "Award", "CannotMeetTerms", "ClearingResult",
    "DEFAULT_LAMBDA_MICRO_PER_S", "InvalidAsk", "InvalidJob", "JobSpec", "MICRO_PER_CREDIT",
    "NoEligibleProvider", "NoMatch", "OrderBook", "Priority", "UnknownAsk", "clear",
    "reference_clear", "validate_ask",
]
