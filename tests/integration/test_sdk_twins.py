"""Client and AsyncClient pass the same behaviour tests against a live broker (uvicorn
front, gRPC gateway, an in-process agent serving echo), and AsyncClient runs 200
generate() calls at once in one event loop."""
from __future__ import annotations

import asyncio
import inspect
import threading
import time

import pytest

from sdk import (Account, AsyncClient, Batch, Client, InsufficientCreditsError,
                 InvalidInputError, Job, JobTimeoutError, NotFoundError, Quote)
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


def test_generate_many_runs_independent_jobs_from_one_request(twin):
    results = twin.run(twin.client.generate_many([
        {"plugin": "echo", "inputs": {"text": "a"}},
        {"plugin": "echo", "inputs": {"text": "b"}, "priority": "fast"},
        {"plugin": "echo", "inputs": {"text": "c"}, "n": 2}]))
    assert [[o["text"] for o in r.json] for r in results] == [["a"], ["b"], ["c", "c"]]
    assert all(r.job.state == "settled" for r in results)


def test_submit_many_returns_jobs_and_batches_in_order_and_replays_by_key(twin):
    items = [{"plugin": "echo", "inputs": {"text": "x"}},
             {"plugin": "echo", "inputs": {"text": "y"}, "n": 2}]
    made = twin.run(twin.client.submit_many(items, idempotency_key="sdk-bulk"))
    assert isinstance(made[0], Job) and isinstance(made[1], Batch)
    assert made[0].data["inputs"]["text"] == "x" and len(made[1].jobs) == 2
    again = twin.run(twin.client.submit_many(items, idempotency_key="sdk-bulk"))
    assert [again[0].id, again[1].id] == [made[0].id, made[1].id]
    assert twin.run(made[0].wait(timeout=30)).json[0]["text"] == "x"
    assert [o["text"] for o in twin.run(made[1].wait(timeout=30)).json] == ["y", "y"]


def test_submit_many_names_the_item_at_fault_and_nothing_is_made(twin, broker):
    before = len(twin.run(twin.client.jobs.list(limit=500)))
    with pytest.raises(InvalidInputError) as checked:  # checked here, before sending
        twin.run(twin.client.submit_many([{"plugin": "echo", "inputs": {"text": "a"}},
                                          {"plugin": "echo", "inputs": {"sleep_ms": -1}}]))
    assert checked.value.field == "jobs[1].inputs.sleep_ms"
    assert str(checked.value).startswith("jobs[1]: ")
    with pytest.raises(InvalidInputError) as refused:  # the broker's own check
        twin.run(twin.client.submit_many([{"plugin": "echo", "inputs": {"sleep_ms": -1}}],
                                         validate=False))
    assert refused.value.field == "jobs[0].inputs.sleep_ms" and refused.value.request_id
    with pytest.raises(NotFoundError) as unknown:
        twin.run(twin.client.submit_many([{"plugin": "echo"}, {"plugin": "nope"}],
                                         validate=False))
    assert unknown.value.field == "jobs[1].plugin" and unknown.value.body["index"] == 1
    poor = Twin(twin.kind, broker.url, broker.key("client", credits=0))
    try:
        with pytest.raises(InsufficientCreditsError) as broke:
            poor.run(poor.client.submit_many([{"plugin": "echo", "inputs": {"text": "a"}}] * 2))
        assert "these 2 jobs" in broke.value.detail
    finally:
        poor.close()
    assert len(twin.run(twin.client.jobs.list(limit=500))) == before


def test_generate_many_cancels_what_still_runs_when_the_timeout_passes(twin):
    slow = {"plugin": "echo", "inputs": {"text": "x", "steps": 50, "sleep_ms": 5000}}
    with pytest.raises(JobTimeoutError) as late:
        twin.run(twin.client.generate_many([slow, slow], timeout=0.5))
    assert late.value.job.state == "cancelled"
    listed = {j.id: j.state for j in twin.run(twin.client.jobs.list(limit=5))}
    assert list(listed.values())[:2] == ["cancelled", "cancelled"]


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
