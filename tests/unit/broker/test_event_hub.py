"""EventHub: a waiter wakes on its own job's notifications, and an end's copy of the job
stands only while nothing else has happened to the job."""
from __future__ import annotations

import threading

from broker.jobs.hub import EventHub


def test_a_waiter_wakes_on_its_job_only():
    hub = EventHub()
    v = hub.version("a")
    woke = []
    t = threading.Thread(target=lambda: woke.append(hub.wait("a", v, 5.0)))
    t.start()
    hub.notify("b")
    hub.notify("a")
    t.join(5)
    assert woke == [v + 1]


def test_an_ends_copy_stands_until_the_job_changes_again():
    hub = EventHub()
    hub.notify("a")
    assert hub.copy("a") is None and not hub.ended("a")
    hub.notify("a", ended=True, copy="settled row")
    assert hub.ended("a") and hub.copy("a") == "settled row"
    hub.notify("a")  # e.g. verification replaced its outputs: the copy is stale
    assert hub.copy("a") is None


def test_copies_are_bounded():
    hub = EventHub()
    hub.MAX_COPIES = 3
    for i in range(5):
        hub.notify(f"j{i}", ended=True, copy=i)
    assert [hub.copy(f"j{i}") for i in range(5)] == [None, None, 2, 3, 4]
