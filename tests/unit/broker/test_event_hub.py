"""EventHub: a waiter wakes on its own job's notifications, and an end's copy of the job
stands only while nothing else has happened to the job."""
from __future__ import annotations

import asyncio
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


def test_asyncio_waiters_are_woken_from_the_thread_that_notifies():
    """A waiting HTTP client served on the event loop is a future, not a thread: a
    hundred of them wake when another thread notifies their job, and only theirs."""
    hub = EventHub()

    async def main():
        before = set(threading.enumerate())
        v = hub.version("a")
        waiters = [asyncio.ensure_future(hub.wait_async("a", v, 30.0)) for _ in range(100)]
        other = asyncio.ensure_future(hub.wait_async("b", hub.version("b"), 30.0))
        await asyncio.sleep(0.01)
        registered = hub.waiting()
        threads = len(set(threading.enumerate()) - before)  # started since, still alive
        t = threading.Thread(target=hub.notify, args=("a",))
        t.start()
        woke = await asyncio.gather(*waiters)
        t.join()
        still = not other.done()
        other.cancel()
        return registered, threads, woke, still

    registered, threads, woke, still = asyncio.run(main())
    assert registered == 101 and woke == [1] * 100 and still
    # no thread per waiter (a hundred wait); one another test left behind may start
    assert threads <= 1
    assert hub.waiting() == 0


def test_an_asyncio_wait_that_times_out_leaves_no_waiter_behind():
    hub = EventHub()
    assert asyncio.run(hub.wait_async("a", 0, 0.05)) == 0
    assert asyncio.run(hub.wait_async("a", 7, 5.0)) == 0  # the version moved: no wait
    assert hub.waiting() == 0
