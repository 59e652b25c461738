"""Clearing by example: who wins, what they are paid, who is refused and why."""
from __future__ import annotations

import dataclasses
import random

import pytest

from auction_factories import CLIENT, ask, job
from broker.auction import (AuctionRules, Award, CannotMeetTerms, ClearingResult,
                            NoEligibleProvider, OrderBook, Priority, clear, reference_clear)

RULES = AuctionRules()  # standard: λ = 100 micro/s, F = 10,000 micro


def book_of(*asks, rules=RULES) -> OrderBook:
    book = OrderBook(rules)
    for a in asks:
        book.post(a)
    return book


@pytest.fixture(params=[clear, reference_clear], ids=["fast", "reference"])
def clear_fn(request):
    return request.param


def test_sole_bidder_is_paid_the_reserve(clear_fn):
    result = clear_fn(job(reserve=700), book_of(ask(price=100)), random.Random(0), 0.0)
    assert result.winner.provider_id == "p1"
    assert result.winner.price_micro_per_unit == 700
    assert result.winner.payment_micro == 7_000
    assert result.winner.price_set_by == "reserve"


def test_winner_is_paid_the_ask_that_would_tie_the_runner_up(clear_fn):
    # Same speed and reliability: scores differ only by price, so the critical ask is the
    # runner-up's ask.
    book = book_of(ask("a", price=100), ask("b", price=130), ask("c", price=400))
    result = clear_fn(job(reserve=1_000), book, random.Random(0), 0.0)
    assert (result.winner.provider_id, result.winner.price_micro_per_unit) == ("a", 130)
    assert result.winner.price_set_by == "runner_up"


def test_critical_ask_accounts_for_speed_exactly(clear_fn):
    # W = 10, λ = 100: a (θ = 10) has time cost 100, b (θ = 5) 200.
    # score_b = 1,200 + 200 = 1,400; a wins while 10·x + 100 ≤ 1,400, so x = 130.
    book = book_of(ask("a", price=110, theta=10.0), ask("b", price=120, theta=5.0))
    result = clear_fn(job(work_units=10.0, reserve=1_000), book, random.Random(0), 0.0)
    assert result.winner.provider_id == "a"
    assert result.winner.price_micro_per_unit == 130


def test_critical_price_is_capped_by_the_reserve(clear_fn):
    book = book_of(ask("a", price=100, theta=50.0), ask("b", price=300, theta=0.5))
    result = clear_fn(job(reserve=300), book, random.Random(0), 0.0)
    assert result.winner.provider_id == "a"
    assert result.winner.price_micro_per_unit == 300
    assert result.winner.price_set_by == "reserve"


def test_at_equal_asks_the_faster_provider_wins(clear_fn):
    book = book_of(ask("slow", price=100, theta=2.0), ask("fast", price=100, theta=20.0))
    for seed in range(10):
        assert clear_fn(job(), book, random.Random(seed), 0.0).winner.provider_id == "fast"


def test_at_equal_asks_the_warm_and_reliable_provider_wins(clear_fn):
    book = book_of(ask("cold", cold_start_s=15.0), ask("warm"),
                   ask("flaky", reliability=0.5))
    assert clear_fn(job(), book, random.Random(0), 0.0).winner.provider_id == "warm"


def test_priority_trades_price_for_speed(clear_fn):
    book = book_of(ask("cheap", price=100, theta=1.0), ask("quick", price=150, theta=20.0))
    w = 10.0  # cheap is 500 micro cheaper and 9.5 s slower
    economy = clear_fn(job(w, priority=Priority.ECONOMY), book, random.Random(0), 0.0)
    fast = clear_fn(job(w, priority=Priority.FAST), book, random.Random(0), 0.0)
    assert economy.winner.provider_id == "cheap"
    assert fast.winner.provider_id == "quick"


def test_ties_break_at_random_but_reproducibly(clear_fn):
    book = book_of(*(ask(f"p{i}", price=100) for i in range(4)))
    winners = [clear_fn(job(), book, random.Random(s), 0.0).winner.provider_id for s in range(60)]
    assert set(winners) == {"p0", "p1", "p2", "p3"}
    again = [clear_fn(job(), book, random.Random(s), 0.0).winner.provider_id for s in range(60)]
    assert winners == again
    # A tied winner is paid its own ask: the runner-up's score equals its own.
    assert clear_fn(job(), book, random.Random(0), 0.0).winner.price_micro_per_unit == 100


def test_result_never_reveals_asks(clear_fn):
    book = book_of(ask("a", price=111), ask("b", price=222), ask("c", price=333))
    result = clear_fn(job(), book, random.Random(0), 0.0)
    fields = {f.name for f in dataclasses.fields(Award)} | {
        f.name for f in dataclasses.fields(ClearingResult)}
    assert not any("ask" in name for name in fields)
    assert "111" not in repr(result) and "333" not in repr(result)


# -- splits -------------------------------------------------------------------------------

def test_k_slots_go_to_the_k_best_at_the_k_plus_first_score(clear_fn):
    book = book_of(*(ask(f"p{i}", price=100 + 10 * i) for i in range(5)))
    result = clear_fn(job(n_slots=3), book, random.Random(0), 0.0)
    assert [a.provider_id for a in result.awards] == ["p0", "p1", "p2"]
    assert {a.price_micro_per_unit for a in result.awards} == {130}
    assert result.unfilled_slots == 0


def test_one_operators_machines_take_one_slot_and_do_not_price_each_other(clear_fn):
    book = book_of(ask("big-1", "big", price=100), ask("big-2", "big", price=101),
                   ask("big-3", "big", price=102), ask("solo", "solo", price=150),
                   ask("other", "other", price=200))
    result = clear_fn(job(n_slots=2), book, random.Random(0), 0.0)
    assert [a.operator_id for a in result.awards] == ["big", "solo"]
    # big's price is set by "other" (the best losing operator), not by its own big-2.
    assert [a.price_micro_per_unit for a in result.awards] == [200, 200]
    single = clear_fn(job(), book, random.Random(0), 0.0)
    assert (single.winner.provider_id, single.winner.price_micro_per_unit) == ("big-1", 150)


def test_fewer_operators_than_slots_fill_other_machines_then_more_slots_at_reserve(clear_fn):
    book = book_of(ask("a1", "a", price=100, slots_free=2), ask("a2", "a", price=110),
                   ask("b1", "b", price=120))
    result = clear_fn(job(n_slots=4, reserve=500), book, random.Random(0), 0.0)
    assert [a.provider_id for a in result.awards] == ["a1", "b1", "a2", "a1"]
    assert all(a.price_micro_per_unit == 500 for a in result.awards)
    partial = clear_fn(job(n_slots=6, reserve=500), book, random.Random(0), 0.0)
    assert len(partial.awards) == 4 and partial.unfilled_slots == 2


# -- eligibility --------------------------------------------------------------------------

@pytest.mark.parametrize("bad, reason", [
    (dict(plugin_version="0.9.0"), "serve another version or weights"),
    (dict(weights_digest="f" * 64), "serve another version or weights"),
    (dict(vram_gb=8.0), "not enough VRAM"),
    (dict(throughput_units_per_s=0.0), "no measured throughput"),
    (dict(throughput_measured=False), "no measured throughput"),
    (dict(price_micro_per_unit=1_001), "above the reserve"),
    (dict(linked_accounts=frozenset({CLIENT})), "linked to the client"),
    (dict(operator_id=CLIENT), "linked to the client"),
    (dict(provider_id="failed-it"), "excluded from this job"),
    (dict(operator_id="first-checker"), "excluded from this job"),
    (dict(online=False), "offline"),
    (dict(slots_free=0), "busy"),
    (dict(expires_at_s=50.0), "ask expired"),
])
def test_each_eligibility_rule_excludes(clear_fn, bad, reason):
    rules = AuctionRules(reputation_floor=0.5)
    book = book_of(ask("good", price=500), dataclasses.replace(ask("bad", price=10), **bad),
                   rules=rules)
    spec = job(reserve=1_000, min_vram_gb=16.0, excluded_provider_ids=frozenset({"failed-it"}),
               excluded_operator_ids=frozenset({"first-checker"}))
    result = clear_fn(spec, book, random.Random(0), 100.0)
    assert result.winner.provider_id == "good"
    book.withdraw("good")
    with pytest.raises(NoEligibleProvider) as err:
        clear_fn(spec, book, random.Random(0), 100.0)
    assert err.value.reasons == {reason: 1}
    assert reason in str(err.value)
    assert err.value.best_price_micro is None and err.value.best_completion_s is None


def test_the_floor_gives_way_only_when_nobody_above_it_could_take_the_job(clear_fn):
    rules = AuctionRules(reputation_floor=0.5)
    shaky = ask("shaky", price=10, reputation=0.2)
    book = book_of(ask("good", price=500), shaky, rules=rules)
    result = clear_fn(job(), book, random.Random(0), 0.0)
    assert result.winner.provider_id == "good" and not result.floor_lifted
    book.update_provider("good", slots_free=0)     # busy: the job waits for it
    with pytest.raises(NoEligibleProvider) as err:
        clear_fn(job(), book, random.Random(0), 0.0)
    assert err.value.reasons == {"busy": 1, "reputation below the floor": 1}
    with pytest.raises(CannotMeetTerms):           # good is free but too slow: no way out
        book.update_provider("good", slots_free=1)
        clear_fn(job(deadline_s=0.5), book, random.Random(0), 0.0)
    for cannot in (dict(linked_accounts=frozenset({CLIENT})), dict(price_micro_per_unit=2_000),
                   dict(online=False), dict(vram_gb=1.0)):
        # good can never take this job: the floor gives way and shaky competes as usual.
        book = book_of(dataclasses.replace(ask("good", price=500), **cannot), shaky,
                       rules=rules)
        result = clear_fn(job(min_vram_gb=16.0), book, random.Random(0), 0.0)
        assert result.winner.provider_id == "shaky" and result.floor_lifted
        assert result.winner.price_set_by == "reserve"
    alone = book_of(shaky, ask("shakier", price=20, reputation=0.1), rules=rules)
    result = clear_fn(job(), alone, random.Random(0), 0.0)  # both under: priced by each other
    assert result.winner.provider_id == "shaky" and result.winner.price_set_by == "runner_up"


def test_claimed_throughput_counts_only_when_the_rules_allow_it(clear_fn):
    rules = AuctionRules(claimed_throughput_factor=0.5)
    book = book_of(ask("measured", price=100, theta=10.0),
                   ask("claimed", price=100, theta=15.0, throughput_measured=False), rules=rules)
    # The claim of 15 counts as 7.5: the measured 10 wins.
    assert clear_fn(job(), book, random.Random(0), 0.0).winner.provider_id == "measured"


# -- refusals -----------------------------------------------------------------------------

def test_refusal_counts_reasons_in_words(clear_fn):
    book = book_of(ask("a", price=2_000), ask("b", price=3_000), ask("c", slots_free=0),
                   ask("d", plugin_version="0.9.0"))
    with pytest.raises(NoEligibleProvider) as err:
        clear_fn(job(reserve=1_000), book, random.Random(0), 0.0)
    message = str(err.value)
    assert "3 providers serve sd15@1.0.0" in message
    assert "2 above the reserve" in message and "1 busy" in message
    assert "1 serve another version or weights" in message
    assert err.value.code == "no_eligible_provider" and err.value.http_status == 503


def test_max_price_refusal_carries_the_best_achievable_price(clear_fn):
    book = book_of(ask("a", price=100), ask("b", price=150))
    with pytest.raises(CannotMeetTerms) as err:
        clear_fn(job(work_units=10.0, max_price_micro=900), book, random.Random(0), 0.0)
    assert err.value.best_price_micro == 1_500     # a at b's ask, W = 10
    assert err.value.best_completion_s == pytest.approx(1.0)
    assert err.value.reasons == {"above the max price": 2}
    # Offering that price clears, and pays no more than it.
    result = clear_fn(job(work_units=10.0, max_price_micro=1_500), book, random.Random(0), 0.0)
    assert result.total_payment_micro <= 1_500


def test_refusals_render_as_problem_json_with_their_terms(clear_fn):
    book = book_of(ask("a", price=100), ask("b", price=150))
    with pytest.raises(CannotMeetTerms) as err:
        clear_fn(job(work_units=10.0, max_price_micro=900), book, random.Random(0), 0.0)
    problem = err.value.problem()
    assert problem["code"] == "cannot_meet_terms" and problem["status"] == 409
    assert problem["best_price_micro"] == 1_500
    assert problem["reasons"] == {"above the max price": 2}


def test_deadline_refusal_carries_the_best_completion_time(clear_fn):
    book = book_of(ask("a", theta=1.0, queue_s=30.0), ask("b", theta=2.0, cold_start_s=10.0))
    with pytest.raises(CannotMeetTerms) as err:
        clear_fn(job(work_units=10.0, deadline_s=12.0), book, random.Random(0), 0.0)
    assert err.value.best_completion_s == pytest.approx(15.0)
    assert err.value.reasons == {"cannot meet the deadline": 2}
    assert "deadline_s=12" in str(err.value)


def test_deadline_picks_the_provider_that_can_meet_it(clear_fn):
    book = book_of(ask("cheap-slow", price=10, theta=0.5), ask("quick", price=500, theta=50.0))
    result = clear_fn(job(work_units=10.0, deadline_s=5.0), book, random.Random(0), 0.0)
    assert result.winner.provider_id == "quick"


def test_max_price_acts_as_a_lower_reserve_for_the_whole_split(clear_fn):
    book = book_of(ask("a", price=100), ask("b", price=110))
    result = clear_fn(job(work_units=10.0, n_slots=2, max_price_micro=2_400),
                      book, random.Random(0), 0.0)
    assert result.reserve_micro_per_unit == 120
    assert all(a.price_micro_per_unit == 120 for a in result.awards)
    assert result.total_payment_micro <= 2_400


def test_max_price_on_decimal_work_units_is_exact():
    """2,200 micro for 2.2 work units allows 1,000 per unit (float division gave 999)."""
    from broker.auction.model import JobSpec
    from broker.auction.scoring import effective_reserve

    job = JobSpec(plugin="echo", plugin_version="1.0.0", weights_digest="any", work_units=2.2,
                  client_id="c", reserve_micro_per_unit=1_000, max_price_micro=2_200)
    assert effective_reserve(job) == 1_000
