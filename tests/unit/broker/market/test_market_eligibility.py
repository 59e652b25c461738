"""MarketService eligibility and score facts: weights pinned per build, the reputation floor,
and expected completion = queue + cold start + W/θ."""
import dataclasses
import hashlib
import random

import pytest

from broker.auction import InvalidJob, NoEligibleProvider
from broker.jobs.presence import Lease
from broker.market import InvalidBenchmark, InvalidMarketRule, MarketService, MarketSettings
from broker.market.builds import ANY_WEIGHTS, manifest_cold_start_s, pinned_digest
from broker.market.store import InMemoryAskStore
from plugins import builtin_plugin_dir
from sdk.protocol.digest import files_digest
from sdk.protocol.manifest import WeightFile, load_manifest

from .agents import connect, occupy

RESERVE = 1_000
ECHO = load_manifest(builtin_plugin_dir("echo"))
WEIGHTS = (WeightFile("model.safetensors", hashlib.sha256(b"w").hexdigest(), 2_000_000_000),)
PINNED = dataclasses.replace(ECHO, weights=WEIGHTS)   # echo@1.0.0 with listed weights
PIN = files_digest((w.path, w.sha256) for w in WEIGHTS)
OTHER = "f" * 64


class Clock:
    def __init__(self, t=1_000.0):
        self.t = t

    def __call__(self):
        return self.t


def market(manifest=None, clock=None, **settings):
    return MarketService(lambda plugin: RESERVE, MarketSettings(**settings),
                         rng=random.Random(7), clock=clock or Clock(),
                         manifest_of=lambda p, v: manifest if manifest is not None
                         and (p, v) == (manifest.name, manifest.version) else None)


def join(m, pid, *, ask=None, theta=10.0, digest="", slots=1, op=None):
    connect(m, pid, op or f"op-{pid}", {"echo": "1.0.0"}, slots=slots,
            digests={"echo": digest}, asks={"echo": ask} if ask else None)
    if theta:
        m.observe(pid, "echo", theta, 1000.0)  # θ units in one second


def spec(m, **kw):
    kw = {"plugin": "echo", "version": "1.0.0", "work_units": 10, "client_id": "c", **kw}
    return m.spec(**kw)


# ---- weights ---------------------------------------------------------------------------
def test_the_pin_comes_from_the_manifest_then_the_job_then_any():
    assert pinned_digest(PINNED) == PIN
    assert pinned_digest(PINNED, job_pin=OTHER) == PIN      # the catalog wins
    assert pinned_digest(ECHO, job_pin=OTHER) == OTHER
    assert pinned_digest(ECHO) == pinned_digest(None) == ANY_WEIGHTS
    m = market(PINNED)
    assert spec(m).weights_digest == PIN
    assert spec(market(ECHO), weights_digest=OTHER).weights_digest == OTHER
    with pytest.raises(InvalidJob) as exc:
        spec(market(ECHO), weights_digest="not-a-digest")
    assert exc.value.field == "weights_digest"


def test_an_agent_with_other_weights_never_wins_a_pinned_job():
    m = market(PINNED)
    join(m, "right", ask=900, theta=1.0, digest=PIN)       # dear and slow, right weights
    join(m, "wrong", ask=1, theta=1_000.0, digest=OTHER)   # cheap and fast, other weights
    join(m, "bare", ask=1, theta=1_000.0, digest="")       # no weights at all
    for seed in range(50):
        m.rng = random.Random(seed)
        for priority in ("economy", "standard", "fast"):
            res = m.clear(spec(m, priority=priority, n_slots=3))
            assert [a.provider_id for a in res.awards] == ["right"]
            assert res.unfilled_slots == 2
    occupy(m, "right")
    with pytest.raises(NoEligibleProvider) as exc:
        m.clear(spec(m))
    assert exc.value.reasons["serve another version or weights"] == 2
    # Nor does the cold market hand it out: outside the auction only the right weights pass.
    assert m.admitted(spec(m)) == {"right"}
    assert m.measured_any("echo", PIN) and m.measured_any("echo", OTHER)
    assert not market(PINNED).measured_any("echo", PIN)


def test_a_job_pin_selects_weights_when_the_manifest_lists_none():
    m = market(ECHO)
    join(m, "a", ask=100, digest=OTHER)
    join(m, "b", ask=500, digest="e" * 64)
    join(m, "c", ask=300, digest="")
    assert m.clear(spec(m)).winner.provider_id == "a"                  # no pin: anyone
    assert m.clear(spec(m, weights_digest="e" * 64)).winner.provider_id == "b"
    assert m.clear(spec(m, weights_digest=ANY_WEIGHTS)).winner.provider_id == "a"
    rows = {r["provider_id"]: r for r in m.asks()}
    assert rows["a"]["weights_digest"] == OTHER and rows["c"]["weights_digest"] == ""


def test_a_reconnect_with_new_weights_moves_the_ask():
    m = market(PINNED)
    join(m, "p", ask=100, digest=OTHER)
    with pytest.raises(NoEligibleProvider):
        m.clear(spec(m))
    join(m, "p", ask=100, digest=PIN)  # the operator fetched the published weights
    assert m.clear(spec(m)).winner.provider_id == "p"


# ---- reputation floor ----------------------------------------------------------------
def test_below_the_floor_waits_for_reliable_providers_and_canaries_lift_it_back():
    m = market(reputation_floor=0.5)
    join(m, "flaky", ask=100)                     # one success (its measurement)
    for _ in range(3):
        m.failed("flaky", "echo")                 # reliability (1+1)/(1+3+1) = 0.4
    assert m.asks({"flaky"})[0]["below_reputation_floor"]
    res = m.clear(spec(m))                        # nobody else serves echo: it gives way
    assert res.winner.provider_id == "flaky" and res.floor_lifted
    assert m.admitted(spec(m)) == {"flaky"}       # the cold market likewise
    join(m, "steady", ask=900)
    assert m.clear(spec(m)).winner.provider_id == "steady"
    assert m.admitted(spec(m)) == {"steady"}
    occupy(m, "steady")                           # busy: the job waits for it
    with pytest.raises(NoEligibleProvider) as exc:
        m.clear(spec(m))
    assert exc.value.reasons == {"busy": 1, "reputation below the floor": 1}
    m.observe("flaky", "echo", 10, 1000.0)        # a canary succeeds: (2+1)/(2+3+1) = 0.5
    res = m.clear(spec(m))
    assert res.winner.provider_id == "flaky" and not res.floor_lifted


def test_admins_move_the_floor_at_run_time_and_it_is_stored():
    store = InMemoryAskStore()
    m = MarketService(lambda p: RESERVE, MarketSettings(reputation_floor=0.5),
                      rng=random.Random(1), clock=Clock(), store=store)
    join(m, "flaky", ask=100)
    join(m, "steady", ask=900, slots=1)
    occupy(m, "steady")
    for _ in range(3):
        m.failed("flaky", "echo")
    with pytest.raises(NoEligibleProvider):
        m.clear(spec(m))
    assert m.set_reputation_floor(0.25, by="admin-1") == 0.25
    assert m.clear(spec(m)).winner.provider_id == "flaky"
    assert m.market_rules()["reputation_floor"] == 0.25
    assert store.rules == {"reputation_floor": 0.25}
    for bad in (-0.1, 1.5, float("nan"), "0.5", True, None):
        with pytest.raises(InvalidMarketRule):
            m.set_reputation_floor(bad)
    assert m.rules.reputation_floor == 0.25


# ---- queue and cold start ---------------------------------------------------------------
def test_the_queue_is_the_backlog_of_held_jobs_and_follows_the_clock():
    clock = Clock()
    m = market(clock=clock)
    join(m, "busy", ask=100, theta=1.0, slots=2)
    join(m, "idle", ask=100, theta=1.0, slots=2)
    m.rng = random.Random(0)
    busy = m.presence.get("busy")                 # 40 s of work on 2 slots: 20 s queue
    assert m.presence.take(busy, "j1", Lease("echo", 40.0, clock()))
    res = m.clear(spec(m, work_units=10))
    assert res.winner.provider_id == "idle" and res.winner.expected_completion_s == 10.0
    assert m.asks({"busy"})[0]["queue_s"] == 20.0
    occupy(m, "idle")
    res = m.clear(spec(m, work_units=10))
    assert res.winner.provider_id == "busy" and res.winner.expected_completion_s == 30.0
    clock.t += 30.0                                # 30 of its 40 s done: 5 s queue
    m.tend("busy")
    assert m.clear(spec(m, work_units=10)).winner.expected_completion_s == 15.0
    m.presence.give_back(busy, "j1")
    assert m.asks({"busy"})[0]["queue_s"] == 0.0
    assert m.clear(spec(m, work_units=10)).winner.expected_completion_s == 10.0


def test_canaries_count_in_the_queue_too():
    from broker.market.service import Canary

    m = market()
    join(m, "p", ask=100, theta=2.0, slots=2)
    m.canary_sent(Canary("c1", "p", "echo", 8.0, 1_000.0))
    assert m.asks({"p"})[0]["queue_s"] == 2.0     # 8 units / 2 per s / 2 slots
    m.canary_done("c1")
    assert m.asks({"p"})[0]["queue_s"] == 0.0


def test_cold_start_when_not_warm_from_report_manifest_or_default():
    m = market(PINNED, default_cold_start_s=7.0)
    join(m, "p", ask=100, theta=1.0, digest=PIN)
    assert m.clear(spec(m, work_units=10)).winner.expected_completion_s == 10.0  # warm
    m.warm = lambda provider_id, plugin: False
    m.refresh("p")
    estimate = manifest_cold_start_s(PINNED)       # 3 s + 2 GB at 500 MB/s = 7 s
    assert estimate == pytest.approx(7.0)
    assert m.clear(spec(m, work_units=10)).winner.expected_completion_s == pytest.approx(
        10.0 + estimate)
    m.report_benchmark("p", "echo", 1.0, cold_start_s=2.5)   # the agent's own load time
    assert m.clear(spec(m, work_units=10)).winner.expected_completion_s == 12.5
    plain = market(ECHO, default_cold_start_s=7.0)
    plain.warm = lambda provider_id, plugin: False
    join(plain, "q", ask=100, theta=1.0)
    assert plain.clear(spec(plain, work_units=10)).winner.expected_completion_s == 17.0


def test_at_equal_asks_the_warm_provider_wins():
    m = market()
    join(m, "warm", ask=100)
    join(m, "cold", ask=100)
    m.warm = lambda provider_id, plugin: provider_id == "warm"
    m.refresh("cold")
    for seed in range(20):
        m.rng = random.Random(seed)
        assert m.clear(spec(m)).winner.provider_id == "warm"


def test_impossible_cold_starts_are_refused_and_record_nothing():
    m = market()
    join(m, "p", ask=100, theta=0)
    for bad in (-1.0, float("inf"), float("nan"), 1e9, True):
        with pytest.raises(InvalidBenchmark):
            m.report_benchmark("p", "echo", 5.0, cold_start_s=bad)
    assert m.theta("p", "echo") == (0.0, False)   # the claim was not recorded either


# ---- memory ----------------------------------------------------------------------------
def test_a_provider_with_less_memory_than_the_manifest_needs_never_wins():
    big = dataclasses.replace(ECHO, min_vram_gb=16.0)
    m = market(big)
    connect(m, "small", "op-small", {"echo": "1.0.0"}, vram_gb=8.0, slots=1,
            digests={"echo": ""}, asks={"echo": 10})
    m.observe("small", "echo", 10.0, 1000.0)
    assert spec(m).min_vram_gb == 16.0
    with pytest.raises(NoEligibleProvider):
        m.clear(spec(m))
    assert m.admitted(spec(m)) == set()  # nor in the cold market
    connect(m, "large", "op-large", {"echo": "1.0.0"}, vram_gb=24.0, slots=1,
            digests={"echo": ""}, asks={"echo": 500})
    m.observe("large", "echo", 10.0, 1000.0)
    assert m.clear(spec(m)).awards[0].provider_id == "large"
