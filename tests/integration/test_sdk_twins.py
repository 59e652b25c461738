"""Client and AsyncClient pass the same behaviour tests against a live broker (uvicorn
front, gRPC gateway, an in-process agent serving echo), and AsyncClient runs 200
generate() calls at once in one event loop."""
from __future__ import annotations

import asyncio
import inspect
import threading
import time

import pytest

from sdk import (Account, AsyncClient, Client, InsufficientCreditsError, JobTimeoutError,
                 NotFoundError, Quote)
from tests.integration.conftest import LiveBroker, agent_starter


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = LiveBroker(tmp_path_factory.mktemp("twins"))
    start, stop_all = agent_starter(b)
    start("twins", slots=16)
    yield b
    stop_all()
    b.stop()


class Twin:
    """One client, sync or async, behind one way of calling it: ``run(value)`` is the
    value itself from a Client and the awaited value from an AsyncClient (on a loop of
    this twin's own, in a thread); ``collect(it)`` lists an iterator or async iterator."""

    def __init__(self, kind: str, url: str, key: str):
        self.kind = kind
        self.loop = None
        if kind == "async":
            self.loop = asyncio.new_event_loop()
            self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
            self.thread.start()
            self.client = AsyncClient(url, key)
        else:
            self.client = Client(url, key)

    def run(self, value):
        if inspect.isawaitable(value):
            assert self.kind == "async", "the sync client returned an awaitable"
            return asyncio.run_coroutine_threadsafe(_awaited(value), self.loop).result(60)
        assert self.kind == "sync", f"the async client returned {value!r}, not an awaitable"
        return value

    def collect(self, it):
        if hasattr(it, "__aiter__"):
            async def gather():
                return [x async for x in it]
            return self.run(gather())
        return list(it)

    def close(self):
        self.run(self.client.close())
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


async def _awaited(aw):
    return await aw


@pytest.fixture(params=["sync", "async"])
def twin(request, broker):
    t = Twin(request.param, broker.url, broker.key("client", credits=100))
    yield t
    t.close()


def test_generate_returns_the_settled_result(twin):
    result = twin.run(twin.client.generate("echo", text="hi"))
    assert result.job.state == "settled" and result.json[0]["text"] == "hi"
    info = result.job.info
    assert info.state == "settled" and info.outputs[0].media_type == "application/json"
    assert info.outputs[0].sha256 == result.outputs[0]["sha256"]


def test_create_wait_and_the_event_stream(twin):
    job = twin.run(twin.client.jobs.create("echo", text="x", steps=3, sleep_ms=30))
    events = twin.collect(job.events())
    kinds = [e.kind for e in events]
    assert kinds[0] == "queued" and kinds[-1] == "done" and "progress" in kinds
    assert [e.id for e in events] == sorted(e.id for e in events)
    result = twin.run(job.wait(timeout=30))
    assert result.json[0]["text"] == "x"
    listed = twin.run(twin.client.jobs.list(limit=5))
    assert job.id in [j.id for j in listed]


def test_errors_carry_the_code_and_the_request_id(twin, broker):
    with pytest.raises(NotFoundError) as missing:
        twin.run(twin.client.jobs.get("00000000-0000-0000-0000-000000000000"))
    assert missing.value.code == "job_not_found" and missing.value.request_id
    poor = Twin(twin.kind, broker.url, broker.key("client", credits=0))
    try:
        price = poor.run(poor.client.quote("echo", text="x"))
        assert isinstance(price, Quote) and price.max_micro == price["max_micro"] > 0
        with pytest.raises(InsufficientCreditsError) as broke:
            poor.run(poor.client.generate("echo", text="x"))
        assert broke.value.code == "insufficient_credits" and broke.value.request_id
    finally:
        poor.close()


def test_a_timeout_cancels_the_job_and_says_what_it_cost(twin):
    with pytest.raises(JobTimeoutError) as late:
        twin.run(twin.client.generate("echo", text="x", sleep_ms=5000, steps=50, timeout=0.5))
    assert late.value.job.state == "cancelled" and late.value.code
    assert "did not finish within the 0.5 s timeout" in str(late.value)


def test_one_timeout_covers_the_stream_and_the_wait(twin):
    """stream()'s timeout counts from the submit over the stream and the wait: a job
    longer than it is cancelled when it passes (its words so far were yielded), not
    followed to its end first; a job's events() stop at their own timeout."""
    got = []
    with pytest.raises(JobTimeoutError) as late:
        async_or_not = twin.client.stream("echo", text="one two three four five six",
                                          stream=True, steps=30, sleep_ms=9000, timeout=2.0)
        if hasattr(async_or_not, "__aiter__"):
            async def gather():
                async for piece in async_or_not:
                    got.append(piece)
            twin.run(gather())
        else:
            got.extend(async_or_not)
    # followed to its end first, the 9 s job would have settled: no timeout, no cancel
    assert late.value.job.state == "cancelled" and "2 s timeout" in str(late.value)
    assert "".join(got).startswith("one")  # what came before the timeout was yielded

    job = twin.run(twin.client.jobs.create("echo", text="x", steps=20, sleep_ms=6000))
    events = twin.collect(job.events(timeout=1.0))
    assert events and events[-1].kind != "done"  # stopped at its timeout, not the job's end
    twin.run(job.cancel())


def test_account_is_typed_and_reads_like_the_dict(twin):
    acct = twin.run(twin.client.account())
    assert isinstance(acct, Account) and acct.role == "client"
    assert acct.available_micro == acct["available_micro"] == 100 * 1_000_000
    tokens = twin.collect(twin.client.stream("echo", text="x"))
    assert tokens == []  # echo streams no text; the stream still ends with the job


def test_two_hundred_concurrent_generates_in_one_event_loop(broker):
    key = broker.key("client", credits=1000)

    async def main():
        async with AsyncClient(broker.url, key) as client:
            await client.generate("echo", text="warm")
            started = time.perf_counter()
            results = await asyncio.gather(*(client.generate("echo", text=f"n{i}")
                                             for i in range(200)))
            return results, time.perf_counter() - started
    results, took = asyncio.run(main())
    assert [r.json[0]["text"] for r in results] == [f"n{i}" for i in range(200)]
    assert len({r.job.id for r in results}) == 200
    print(f"\nAsyncClient: 200 concurrent generate() in one event loop: {took:.2f} s "
          f"({200 / took:.0f} jobs/s)")
