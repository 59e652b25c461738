"""The market reads who is online, free slots and leases from the ProviderPresence it is
built on (issue #21): no copy of its own, no sync calls; the lock order presence → market."""
import random
import threading

import pytest

from broker.auction import NoEligibleProvider
from broker.jobs.dispatch import Dispatcher
from broker.jobs.presence import Lease, ProviderPresence
from broker.market import InvalidBenchmark, MarketService, MarketSettings
from broker.market.errors import PluginNotServed

from .agents import connect, leave

RESERVE = 1_000


class Clock:
    def __init__(self, t=1_000.0):
        self.t = t

    def __call__(self):
        return self.t


def market(clock=None, presence=None):
    return MarketService(lambda plugin: RESERVE, MarketSettings(), rng=random.Random(5),
                         clock=clock or Clock(), presence=presence)


def spec(m, **kw):
    return m.spec(**{"plugin": "echo", "version": "1.0.0", "work_units": 10, "client_id": "c",
                     **kw})


def row(m, pid):
    [r] = m.asks({pid})
    return r


def test_slots_leases_and_online_come_from_the_presence():
    clock = Clock()
    m = market(clock)
    session = connect(m, "p", "op", {"echo": "1.0.0"}, slots=2, asks={"echo": 300})
    m.observe("p", "echo", 1.0, 1000.0)                    # θ = 1 unit/s
    assert row(m, "p")["online"] and row(m, "p")["queue_s"] == 0.0
    assert m.presence.take(session, "j1", Lease("echo", 40.0, clock()))
    assert row(m, "p")["queue_s"] == 20.0                  # 40 s on 2 slots, heard at once
    assert m.clear(spec(m)).winner.expected_completion_s == 30.0
    assert m.presence.take(session, "j2", Lease("echo", 0.0, clock()))
    with pytest.raises(NoEligibleProvider) as exc:         # both slots taken: busy
        m.clear(spec(m))
    assert exc.value.reasons == {"busy": 1}
    m.presence.release("p", "j2")
    m.presence.give_back(session, "j1")
    assert row(m, "p")["queue_s"] == 0.0 and m.clear(spec(m)).winner.provider_id == "p"
    m.presence.set_paused("p", True)                       # paused: no free slot
    with pytest.raises(NoEligibleProvider):
        m.clear(spec(m))
    m.presence.set_paused("p", False)
    assert m.clear(spec(m)).winner.provider_id == "p"
    leave(m, "p")                                          # its stream ended
    assert not row(m, "p")["online"] and row(m, "p")["price_micro_per_unit"] == 300
    assert m.admitted(spec(m)) == set() and not m.measured_any("echo")
    with pytest.raises(NoEligibleProvider):
        m.clear(spec(m))


def test_a_reconnect_keeps_the_leases_and_the_old_stream_closing_changes_nothing():
    clock = Clock()
    m = market(clock)
    old = connect(m, "p", "op", {"echo": "1.0.0"}, slots=2)
    m.observe("p", "echo", 1.0, 1000.0)
    assert m.presence.take(old, "j1", Lease("echo", 40.0, clock()))
    new = connect(m, "p", "op", {"echo": "1.0.0"}, slots=2)  # before the old stream closed
    assert new.leases == {"j1": Lease("echo", 40.0, clock())} and "j1" in new.active
    assert not m.presence.remove(old)                        # the old stream closes now
    assert row(m, "p")["online"] and row(m, "p")["queue_s"] == 20.0
    assert m.clear(spec(m)).winner.provider_id == "p"


def test_what_the_agent_offers_is_answered_on_the_session():
    m = market()
    connect(m, "p", "op", {"echo": "1.0.0"}, asks={"echo": 300})
    session = connect(m, "p", "op", {"echo": "1.0.0"}, benchmarks={"echo": -1.0},
                      asks={"echo": 0})
    bench, ask = session.offer_replies
    assert bench.kind == "benchmark" and isinstance(bench.error, InvalidBenchmark)
    assert ask.kind == "ask" and ask.error is not None and ask.price == 300  # it stands
    assert session.offer is None                             # read once
    other = connect(m, "q", "op", {"echo": "1.0.0"}, asks={"sd15": 5})
    [refused] = other.offer_replies
    assert isinstance(refused.error, PluginNotServed) and refused.price == 0


def test_the_dispatcher_and_its_market_share_one_presence():
    m = market()
    with pytest.raises(ValueError, match="share one ProviderPresence"):
        Dispatcher(_Jobs(), market=m, presence=ProviderPresence())
    assert Dispatcher(_Jobs(), market=m).presence is m.presence
    assert Dispatcher(_Jobs(), market=m, presence=m.presence).presence is m.presence


class _Jobs:
    """Just what the dispatcher's constructor touches of a job service."""


def test_the_presence_and_the_market_never_wait_on_each_other():
    """Slots taken and given back (presence lock, then the market's) while the market is
    read and re-posted from other threads (the same order): nobody deadlocks."""
    clock = Clock()
    m = market(clock)
    sessions = [connect(m, f"p{i}", f"op{i}", {"echo": "1.0.0"}, slots=4) for i in range(4)]
    stop = threading.Event()

    def slots(s):
        n = 0
        while not stop.is_set():
            n += 1
            if m.presence.take(s, f"j{n}", Lease("echo", 5.0, clock())):
                m.presence.give_back(s, f"j{n}")

    def market_side():
        while not stop.is_set():
            for s in sessions:
                m.observe(s.provider_id, "echo", 10.0, 1000.0)
                m.tend(s.provider_id)
                m.refresh(s.provider_id)
                m.asks({s.provider_id})
                try:
                    m.clear(spec(m))
                except NoEligibleProvider:
                    pass

    threads = [threading.Thread(target=slots, args=(s,), daemon=True) for s in sessions]
    threads += [threading.Thread(target=market_side, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    stop.wait(1.5)
    stop.set()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "a lock-order deadlock"
    assert all(not s.active and not s.leases for s in sessions)
    assert {r["queue_s"] for r in m.asks()} == {0.0}


def test_a_slot_is_taken_only_on_the_session_held_now():
    """A session replaced by a reconnect (or closed) is not where a job or canary can go:
    what is sent on its stream goes nowhere and would only wait out its deadline."""
    presence = ProviderPresence()
    m = market(presence=presence)
    old = connect(m, "p", "op", {"echo": "1.0.0"})
    new = connect(m, "p", "op", {"echo": "1.0.0"})
    assert not presence.take(old, "job-1", Lease("echo", 1.0, 0.0))
    assert presence.take(new, "job-1", Lease("echo", 1.0, 0.0))
    leave(m, "p")
    assert not presence.take(new, "job-2", Lease("echo", 1.0, 0.0))


def test_a_slot_given_back_on_the_replaced_session_is_free_on_the_new_one():
    """The new session took the old one's jobs over; an answer read on the old stream
    (handled after the reconnect) frees the slot where it is counted now."""
    m = market()
    old = connect(m, "p", "op", {"echo": "1.0.0"})
    assert m.presence.take(old, "job-1", Lease("echo", 1.0, 0.0))
    new = connect(m, "p", "op", {"echo": "1.0.0"})
    assert "job-1" in new.active and new.free == 0
    m.presence.give_back(old, "job-1")
    assert "job-1" not in new.active and "job-1" not in new.leases and new.free == 1


def test_the_old_stream_leaving_after_a_reconnect_keeps_the_new_asks_in_the_book():
    """remove() tells the listeners outside the presence's lock: when the agent's new
    stream was held meanwhile, the market keeps its asks (they were posted by it)."""
    presence = ProviderPresence()
    held = {}

    class Reconnect:  # heard before the market: the agent is back before the market hears
        def joining(self, s): pass
        def joined(self, s): pass
        def changed(self, s, moved): pass

        def left(self, s):
            held.setdefault("new", None) or held.update(
                new=connect(m, "p", "op", {"echo": "1.0.0"}))

    presence.listen(Reconnect())
    m = market(presence=presence)
    old = connect(m, "p", "op", {"echo": "1.0.0"}, benchmarks={"echo": 5.0})
    assert m.book._by_provider.get("p")
    presence.remove(old)
    assert presence.get("p") is held["new"]
    assert m.book._by_provider.get("p")
