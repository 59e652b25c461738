"""Traceable requests (issue #25): a request's X-Request-Id (the client's, or a new one)
comes back on every answer and RFC 7807 body, stays with the jobs it made, travels as its
digest in their envelopes, and names the agent's and the plugin host's log lines about
them; the SDK's errors carry it."""
from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from broker.settings import BUILTIN_PLUGINS
from sdk import Client, JobFailedError, NotFoundError, logs
from tests.integration.conftest import LiveBroker, agent_starter

TRACE_PLUGINS = Path(__file__).resolve().parents[1] / "fixtures" / "trace_plugins"


@contextmanager
def _traced(tmp_path):
    broker = LiveBroker(tmp_path, plugin_dirs=[BUILTIN_PLUGINS, TRACE_PLUGINS])
    start, stop_all = agent_starter(broker)
    try:
        yield broker, start("tracer", plugins={"chatty": TRACE_PLUGINS / "chatty"})
    finally:
        stop_all()
        broker.stop()


@pytest.fixture
def traced(tmp_path):
    with _traced(tmp_path) as got:
        yield got


class _Records(logging.Handler):
    """The agent's log records with their context's fields (sdk.logs.ContextFilter)."""

    def __init__(self):
        super().__init__()
        self.addFilter(logs.ContextFilter())
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_a_request_id_travels_to_the_agent_and_the_plugin_host(capfd, tmp_path):
    # Started here, while capfd holds stderr: the plugin host inherits it.
    with _traced(tmp_path) as (broker, _agent):
        _travels(broker, capfd)


def _travels(broker, capfd):
    key = broker.key("client")
    seen = _Records()
    logging.getLogger("agent").addHandler(seen)
    try:
        r = httpx.post(f"{broker.url}/v1/jobs", timeout=30,
                       headers={"Authorization": f"Bearer {key}", "X-Request-Id": "trace-me-42",
                                "Prefer": "wait=20"},
                       json={"plugin": "chatty", "inputs": {"text": "hi", "fail": True}})
        assert r.headers["X-Request-Id"] == "trace-me-42"
        job = r.json()
        assert job["request_id"] == "trace-me-42" and job["state"] == "failed"
    finally:
        logging.getLogger("agent").removeHandler(seen)
    digest = logs.request_digest("trace-me-42")
    # The agent's lines about the job (its failure) carry the job and the request's digest.
    about = [rec for rec in seen.records if rec.context.get("job_id") == job["id"]]
    assert about and all(rec.context["request_id"] == digest for rec in about)
    assert any("failed" in rec.getMessage() for rec in about)
    # The plugin host's stderr: the plugin's own logging line and the host's, both tagged.
    err = _until_in(capfd, "chatty was asked to fail")
    tagged = f" [job {job['id']} request {digest}]"
    assert f"chatty{tagged}: chatty is working on 'hi'" in err
    assert f"plugin_host{tagged}: job failed: chatty was asked to fail (asked_to_fail)" in err
    # The client's own text never reaches the provider: not in any line the plugin host
    # wrote (capfd also holds this process's stderr, where the in-process broker may log,
    # and where logging prints a late record of another test's thread, arguments and all).
    host_lines = [line for line in err.splitlines() if "[job " in line]
    assert host_lines and not any("trace-me-42" in line for line in host_lines)


def _until_in(capfd, text: str, timeout_s: float = 10.0) -> str:
    seen = ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen += capfd.readouterr().err
        if text in seen:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in the agent's stderr:\n{seen[-3000:]}")


def test_errors_carry_the_request_id_and_the_sdk_raises_it(traced):
    broker, _ = traced
    key = broker.key("client")
    r = httpx.get(f"{broker.url}/v1/jobs/nope", headers={"Authorization": f"Bearer {key}"},
                  timeout=10)
    assert r.status_code == 404
    assert r.json()["request_id"] == r.headers["X-Request-Id"]
    # A refusal the front answers itself (not the Flask app) names one too.
    ready = httpx.get(f"{broker.url}/readyz", headers={"X-Request-Id": "bad id!"}, timeout=10)
    assert ready.status_code == 200
    broker.server.drain()
    resp = httpx.get(f"{broker.url}/readyz", headers={"X-Request-Id": "lb-probe-7"}, timeout=10)
    assert resp.status_code == 503
    assert resp.json()["request_id"] == "lb-probe-7" == resp.headers["X-Request-Id"]
    unnamed = httpx.get(f"{broker.url}/readyz", timeout=10)
    assert unnamed.json()["request_id"] and unnamed.json()["request_id"] != "lb-probe-7"

    with Client(broker.url, key) as client:
        with pytest.raises(NotFoundError) as exc:
            client.jobs.get("no-such-job")
        assert exc.value.request_id


def test_a_failed_job_raises_with_its_request_id(traced):
    broker, _ = traced
    with Client(broker.url, broker.key("client")) as client:
        with pytest.raises(JobFailedError) as exc:
            client.generate("chatty", text="x", fail=True)
    assert exc.value.request_id and exc.value.request_id == exc.value.job.request_id


def test_json_logs_name_the_request(capsys):
    import io

    out = io.StringIO()
    logs.configure("json", stream=out)
    try:
        with logs.bound(request_id="abc", job_id="j-1"):
            logging.getLogger("broker.test").info("hello %s", "world")
        logging.getLogger("broker.test").warning("outside")
    finally:
        logs.configure("text")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["message"] == "hello world" and first["request_id"] == "abc"
    assert first["job_id"] == "j-1" and first["level"] == "INFO"
    assert first["logger"] == "broker.test" and first["time"].endswith("Z")
    assert "request_id" not in second
    with pytest.raises(ValueError, match="text, json"):
        logs.configure("yaml")
