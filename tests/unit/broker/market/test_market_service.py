"""MarketService: asks validated and sealed, θ measured and preferred to claims, clearing."""
import random

import pytest

from broker.auction import CannotMeetTerms, InvalidAsk
from broker.market import InvalidBenchmark, MarketService, MarketSettings, PluginNotServed

from .agents import connect

RESERVE = 1_000


def market(**settings):
    return MarketService(lambda plugin: RESERVE, MarketSettings(**settings),
                         rng=random.Random(1), clock=lambda: 1_000.0)


def join(m, pid, *, ask=None, measured=None, claim=None, op=None):
    connect(m, pid, op or f"op-{pid}", {"echo": "1.0.0"},
            benchmarks={"echo": claim} if claim else None,
            asks={"echo": ask} if ask else None)
    if measured:
        m.observe(pid, "echo", measured, 1000.0)  # `measured` units in one second


def test_bad_asks_are_refused_and_the_previous_ask_stands():
    m = market()
    join(m, "p1", ask=500, measured=10)
    for bad in (-5, 0, 10**12, 1.5, True):
        with pytest.raises(InvalidAsk) as exc:
            m.post_ask("p1", "echo", bad)
        assert "price_micro_per_unit" in str(exc.value)
    with pytest.raises(PluginNotServed):
        m.post_ask("p1", "sd15", 100)
    for bad in (-1.0, 0.0, float("inf"), float("nan"), 1e12):
        with pytest.raises(InvalidBenchmark):
            m.report_benchmark("p1", "echo", bad)
    [row] = m.asks({"p1"})
    assert row["price_micro_per_unit"] == 500 and not row["at_reserve"]


def test_unmeasured_claims_are_ineligible_and_asks_default_to_the_reserve():
    m = market()
    join(m, "p1", claim=50.0)
    assert m.theta("p1", "echo") == (50.0, False)
    assert m.canaries_due("p1") == ["echo"]
    assert not m.measured_any("echo")
    join(m, "p2", measured=5)
    res = m.clear(m.spec(plugin="echo", version="1.0.0", work_units=1, client_id="c"))
    assert res.winner.provider_id == "p2" and res.winner.price_micro_per_unit == RESERVE


def test_cheaper_wins_and_is_paid_the_runner_up_critical_price():
    m = market()
    join(m, "cheap", ask=200, measured=10)
    join(m, "dear", ask=600, measured=10)
    res = m.clear(m.spec(plugin="echo", version="1.0.0", work_units=2, client_id="c"))
    assert res.winner.provider_id == "cheap"
    assert 200 <= res.winner.price_micro_per_unit <= 600


def test_an_overclaiming_provider_is_flagged_measured_and_stops_winning():
    m = market(claimed_throughput_factor=1.0)  # an admin lets claims in before measuring
    join(m, "liar", ask=500, claim=1_000.0)
    join(m, "honest", ask=500, measured=10)
    spec = m.spec(plugin="echo", version="1.0.0", work_units=10, client_id="c", priority="fast")
    assert m.clear(spec).winner.provider_id == "liar"     # on its claim
    m.observe("liar", "echo", 10, 10_000.0)               # its real job: 1 unit/s
    assert m.theta("liar", "echo") == (1.0, True)
    assert m.flagged("liar", "echo")
    assert m.asks({"liar"})[0]["overclaim_flagged"] is True
    for _ in range(5):
        assert m.clear(spec).winner.provider_id == "honest"


def test_split_goes_to_four_operators_and_terms_refusal_names_the_best_terms():
    m = market()
    for i, ask in enumerate((100, 200, 300, 400, 500)):
        join(m, f"p{i}", ask=ask, measured=10)
    join(m, "p0-twin", ask=100, measured=10, op="op-p0")
    res = m.clear(m.spec(plugin="echo", version="1.0.0", work_units=1, client_id="c", n_slots=4))
    assert sorted(a.provider_id for a in res.awards) == ["p0", "p1", "p2", "p3"] or \
        sorted(a.provider_id for a in res.awards) == ["p0-twin", "p1", "p2", "p3"]
    assert len({a.operator_id for a in res.awards}) == 4
    with pytest.raises(CannotMeetTerms) as exc:
        m.check_terms(m.spec(plugin="echo", version="1.0.0", work_units=1, client_id="c",
                             max_price_micro=10))
    assert exc.value.best_price_micro is not None and exc.value.best_completion_s is not None
    with pytest.raises(CannotMeetTerms):
        m.check_terms(m.spec(plugin="echo", version="1.0.0", work_units=1, client_id="c",
                             deadline_s=0.001))


def test_a_run_the_broker_did_not_time_measures_nothing():
    from broker.market.throughput import timed_sample

    assert timed_sample({"work_units": "2.000000"}, 1.0, None, 5.0) is None  # never sent
    assert timed_sample({"timings_ms": {"run": 0}}, 0.0, 1.0, 2.0) is None     # no units
    assert timed_sample({"timings_ms": {"run": 0}, "work_units": "x"}, 3.0, 1.0, 1.0) == (3.0, 0.0)
    assert timed_sample({"timings_ms": {"total": 40}, "work_units": "2.5"}, 3.0,
                        1.0, 1.04) == pytest.approx((2.5, 40.0))


def test_an_ask_outlives_a_plugin_dropped_and_served_again():
    from broker.market.store import InMemoryAskStore

    store = InMemoryAskStore()
    m = MarketService(lambda plugin: RESERVE, MarketSettings(), rng=random.Random(1),
                      clock=lambda: 1_000.0, store=store)
    connect(m, "p1", "op", {"echo": "1.0.0", "sd15": "1.0.0"}, asks={"echo": 300, "sd15": 700})
    assert store.load_asks() == {"p1": {"echo": 300, "sd15": 700}}
    connect(m, "p1", "op", {"echo": "1.0.0"})                    # sd15 dropped
    assert {r["plugin"] for r in m.asks({"p1"})} == {"echo"}
    connect(m, "p1", "op", {"echo": "1.0.0", "sd15": "1.0.0"})   # and served again
    rows = {r["plugin"]: r for r in m.asks({"p1"})}
    assert rows["sd15"]["price_micro_per_unit"] == 700 and not rows["sd15"]["at_reserve"]
    m.post_ask("p1", "echo", 250)
    assert store.load_asks()["p1"]["echo"] == 250


def test_the_ask_store_is_written_outside_the_clearing_lock():
    from broker.market.store import InMemoryAskStore

    m = MarketService(lambda plugin: RESERVE, MarketSettings(), rng=random.Random(1),
                      clock=lambda: 1_000.0, store=InMemoryAskStore())
    held = []
    real = m.store.save_ask

    def save_ask(*args, **kwargs):
        held.append(m._lock._is_owned())  # RLock: whether this thread holds it
        return real(*args, **kwargs)

    m.store.save_ask = save_ask
    connect(m, "p1", "op", {"echo": "1.0.0"}, asks={"echo": 300})
    m.post_ask("p1", "echo", 400)
    assert held == [False, False]


def test_a_changed_reputation_floor_is_reported_with_before_and_after():
    m = market()
    seen = []
    m.on_rule_changed = lambda *args: seen.append(args)
    m.set_reputation_floor(0.7, by="admin-1")
    m.set_reputation_floor(0.2, by="admin-2")
    assert seen == [("reputation_floor", 0.5, 0.7, "admin-1"),
                    ("reputation_floor", 0.7, 0.2, "admin-2")]


def test_a_provider_never_wins_the_job_of_a_client_linked_to_its_operator():
    m = MarketService(lambda plugin: RESERVE, MarketSettings(), rng=random.Random(1),
                      clock=lambda: 1_000.0,
                      linked_to=lambda op: {"client-x"} if op == "op-cheap" else set())
    join(m, "cheap", ask=100, measured=10.0)
    join(m, "dear", ask=900, measured=10.0)
    spec = lambda client: m.spec(plugin="echo", version="1.0.0", work_units=1.0,  # noqa: E731
                                 client_id=client)
    assert m.clear(spec("client-y")).awards[0].provider_id == "cheap"
    assert m.clear(spec("client-x")).awards[0].provider_id == "dear"
