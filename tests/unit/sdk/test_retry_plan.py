"""The SDK's sans-IO request plan (sdk._core.request), driven by hand: what it asks to
send, how long it asks to sleep, and what it raises — the one definition both Client and
AsyncClient run."""
from __future__ import annotations

import email.utils
import time

from sdk import _core as core
from sdk._http import Response
from sdk.errors import APIConnectionError, RateLimitError


def cfg(max_retries=3):
    c = core.Config.build("http://127.0.0.1:9", "sc_client_x", 5.0, max_retries)
    c.backoff = lambda attempt: 0.125 * (attempt + 1)
    return c


def drive(plan, outcomes):
    """Run ``plan`` against the scripted outcomes; returns (steps, value or exception)."""
    steps, outcomes = [], list(outcomes)
    try:
        step = next(plan)
        while True:
            steps.append(step)
            step = plan.send(outcomes.pop(0) if isinstance(step, core.Call) else None)
    except StopIteration as stop:
        return steps, stop.value
    except Exception as exc:  # noqa: BLE001 - what the plan raised is the result
        return steps, exc


def answer(status, headers=None, body=b"{}"):
    return Response(status, {"Content-Type": "application/json", **(headers or {})}, body)


def test_retry_after_seconds_is_honoured_and_the_key_is_reused():
    plan = core.request(cfg(), "POST", "/v1/jobs", json_body={"a": 1}, idempotency_key="k1")
    steps, value = drive(plan, [answer(429, {"Retry-After": "2"}), answer(503), answer(200)])
    calls = [s for s in steps if isinstance(s, core.Call)]
    sleeps = [s.seconds for s in steps if isinstance(s, core.Sleep)]
    assert sleeps == [2.0, 0.25]  # Retry-After, then the backoff of the second attempt
    assert {c.headers["Idempotency-Key"] for c in calls} == {"k1"} and len(calls) == 3
    assert value.status_code == 200


def test_an_http_date_retry_after_and_a_long_one_is_capped():
    soon = email.utils.formatdate(time.time() + 30, usegmt=True)
    steps, _ = drive(core.request(cfg(), "GET", "/v1/jobs"),
                     [answer(429, {"Retry-After": soon}),
                      answer(429, {"Retry-After": "86400"}), answer(200)])
    sleeps = [s.seconds for s in steps if isinstance(s, core.Sleep)]
    assert 25 < sleeps[0] <= 30 and sleeps[1] == core.MAX_RETRY_AFTER_S


def test_a_429_after_the_retries_is_a_rate_limit_error_with_its_ids():
    body = b'{"code": "rate_limited", "detail": "slow down", "request_id": "r-9"}'
    _, exc = drive(core.request(cfg(max_retries=1), "GET", "/v1/jobs"),
                   [answer(429, {"Retry-After": "1"}, body),
                    answer(429, {"Retry-After": "7", "X-Request-Id": "r-10"}, body)])
    assert isinstance(exc, RateLimitError)
    assert (exc.code, exc.request_id, exc.retry_after_s, exc.status) == ("rate_limited",
                                                                          "r-10", 7.0, 429)


def test_transport_failures_back_off_then_say_the_broker_is_unreachable():
    steps, exc = drive(core.request(cfg(max_retries=2), "GET", "/v1/jobs"),
                       [core.Failed("connection refused")] * 3)
    assert [s.seconds for s in steps if isinstance(s, core.Sleep)] == [0.125, 0.25]
    assert isinstance(exc, APIConnectionError) and exc.code == "connection_error"
    assert "connection refused" in str(exc)


def test_the_key_goes_to_no_other_host():
    steps, exc = drive(core.request(cfg(), "GET", "http://elsewhere.example/v1/jobs"), [])
    assert steps == [] and isinstance(exc, ValueError)
    assert "refusing to send the API key" in str(exc)


def test_one_timeout_is_counted_once_from_when_it_began():
    import pytest

    from sdk.errors import ConfigurationError

    budget = core.Timeout(10.0, started=time.monotonic() - 4.0)
    assert 5.5 < budget.left() <= 6.0 and not budget.passed
    assert core.Timeout.of(budget) is budget  # handed on, not restarted
    assert core.Timeout(1.0, started=time.monotonic() - 2.0).passed
    assert core.Timeout.of(None).left() is None and not core.Timeout(None).passed
    for bad in (-1, float("nan"), "10"):
        with pytest.raises(ConfigurationError, match="timeout must be a number of seconds"):
            core.Timeout(bad)
