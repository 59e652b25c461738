"""What the SDK's waiting tells a user: the timeout they gave and what a cancel cost, and
jobs from a listing that wait and fetch like any other (issue #30, the newcomer's path)."""
import re

import pytest

from sdk import Client, JobTimeoutError


def _available(client: Client) -> int:
    return client.account()["available_micro"]


def test_generate_timeout_names_the_timeout_given_and_the_time_waited(live_broker, start_agent):
    start_agent("a1")
    with Client(live_broker.url, live_broker.key("client")) as client:
        with pytest.raises(JobTimeoutError) as exc:
            client.generate("echo", text="slow", sleep_ms=60000, steps=600, timeout=2)
    err = exc.value
    message = str(err)
    assert "within the 2 s timeout" in message, message
    assert not re.search(r"(within|waited) -", message), message  # no negative durations
    assert err.timeout_s == 2 and err.waited_s >= 2
    assert f"waited {err.waited_s:.3g} s" in message
    assert err.job.state == "cancelled"


def test_timeout_error_says_what_the_cancel_charged_and_for_what(live_broker, start_agent):
    start_agent("a1")
    with Client(live_broker.url, live_broker.key("client")) as client:
        before = _available(client)
        # 300 steps of 20 ms: a checkpoint every 60 steps (the broker's default, about 4
        # a job); a cancel pays only the work shown (issue #20), so wait past the first
        job = client.jobs.create("echo", text="slow", sleep_ms=6000, steps=300)
        for ev in job.events():
            if ev.kind == "progress" and ev.data.get("step", 0) >= 75:
                break
        with pytest.raises(JobTimeoutError) as exc:
            job.wait(timeout=0)
        err = exc.value
        lost = before - _available(client)
    assert err.job.state == "cancelled"
    # the amount the error names is what the client's balance lost, and it is not nothing:
    # the provider is paid for the steps it checkpointed
    assert err.charged_micro == lost and lost > 0
    message = str(err)
    assert f"{lost:,} micro-credits" in message, message
    assert re.search(r"for the work the provider showed before the cancel \(the checkpoints "
                     r".*it had reported \d+ of 300 steps\)", message), message
    assert "the rest of the hold was released" in message


def test_timeout_before_any_step_says_nothing_was_charged(live_broker, start_agent):
    # the agent's one slot is busy: the second job waits in the queue, nothing of it is
    # done, nothing of it is charged
    start_agent("a1", slots=1)
    with Client(live_broker.url, live_broker.key("client")) as client:
        busy = client.jobs.create("echo", text="busy", sleep_ms=30000, steps=300)
        for ev in busy.events():
            if ev.kind == "progress":
                break
        before = _available(client)
        job = client.jobs.create("echo", text="waits")
        assert job.refresh().state == "queued"
        with pytest.raises(JobTimeoutError) as exc:
            job.wait(timeout=0)
        assert _available(client) == before
        busy.cancel()
    assert exc.value.charged_micro == 0
    assert "nothing was charged (no step was done yet)" in str(exc.value)


def test_a_listed_job_waits_and_fetches_like_any_other(live_broker, start_agent):
    start_agent("a1")
    with Client(live_broker.url, live_broker.key("client")) as client:
        done = client.generate("echo", text="listed")
        listed = {j.id: j for j in client.jobs.list()}
        result = listed[done.job.id].wait(timeout=30)
        assert result.json == [{"text": "listed"}]
        assert len(result.outputs) == 1 and result.meta == done.meta
