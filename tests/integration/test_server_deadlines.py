"""Deadlines kept by the broker (issue #21): a job not done by its ``deadline_s`` fails
``deadline_exceeded`` at the deadline, its agent is told to stop (its slot takes the next
job), and the client gets its hold back except for the work checkpoints saved. Before, a
``deadline_s=1.5`` job of 4 s ran on and settled, charged in full, at 5.5 s."""
from __future__ import annotations

import time

from sdk import Client
from sdk.errors import JobFailedError


def _available(client):
    return client.account()["available_micro"]


def test_a_job_past_its_deadline_is_stopped_and_refunded(live_broker, start_agent):
    start_agent("a1", slots=1)
    with Client(live_broker.url, live_broker.key("client")) as client:
        client.generate("echo", text="warm-up")  # the canary and a first θ
        before = _available(client)
        t0 = time.monotonic()
        job = client.jobs.create("echo", text="slow", sleep_ms=4000, steps=4,
                                 terms={"deadline_s": 1.5})
        try:
            job.wait(timeout=10)
        except JobFailedError:
            pass
        took = time.monotonic() - t0
        ended = job.refresh()
        assert ended.state == "failed" and ended.data["error"]["code"] == "deadline_exceeded", ended
        assert took < 3.5, took  # at the deadline (+ the reaper's 0.5 s), not after 4 s
        assert _available(client) == before  # four steps, none checkpointed: nothing paid
        # The agent was told to stop: its one slot runs the next job at once.
        t1 = time.monotonic()
        assert client.generate("echo", text="next", timeout=10).json[0]["text"] == "next"
        assert time.monotonic() - t1 < 2.5


def test_a_job_past_its_deadline_pays_only_what_its_checkpoints_saved(live_broker, start_agent):
    start_agent("a1", slots=1)
    with Client(live_broker.url, live_broker.key("client")) as client:
        client.generate("echo", text="warm-up")
        before = _available(client)
        # 40 steps of 100 ms, a checkpoint every 10 steps: by 2.5 s one or two are saved
        job = client.jobs.create("echo", text="slow", sleep_ms=4000, steps=40,
                                 terms={"deadline_s": 2.5})
        try:
            job.wait(timeout=10)
        except JobFailedError:
            pass
        ended = job.refresh()
        assert ended.state == "failed" and ended.data["error"]["code"] == "deadline_exceeded"
        paid = before - _available(client)
        checkpoints = [e for e in job.events() if e.kind == "checkpoint"]
        assert checkpoints, "the echo plugin checkpointed"
        assert paid > 0
        # what was paid is the saved share of the job's maximum price, not the steps run
        step = max(e.data["step"] for e in checkpoints)
        held = live_broker.services.jobs.repo.get(job.id).max_price_micro
        assert paid <= held * step // 40 + 1, (paid, held, step)
