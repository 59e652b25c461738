"""Two broker replicas (each a full BrokerServer: its own engine, hub, dispatcher, gRPC and
HTTP) on one PostgreSQL database, an agent connected to A and the client talking to B
(issue #21). Before the replicas woke each other through LISTEN/NOTIFY, a job through B
took 5 s (B's hub heard of the end only from its quiet-slice re-read), a cancel sent to B
never reached the agent (and A kept its slot busy), and a pause through B did nothing."""
from __future__ import annotations

import base64
import os
import time

import pytest

from sdk import Client

from tests.integration.conftest import LiveBroker, agent_starter


@pytest.fixture
def replicas(tmp_path, pg_url):
    # what replicas share (docs/architecture.md, *Replicas*): the signing key, the blob
    # store and the at-rest key that seals job rows (issue #23)
    at_rest = base64.b64encode(os.urandom(32)).decode()
    shared = {"key_path": tmp_path / "broker.key", "blob_dir": tmp_path / "blobs",
              "at_rest_key": at_rest}
    a = LiveBroker(tmp_path / "a", db_url=pg_url, **shared)
    b = LiveBroker(tmp_path / "b", db_url=pg_url, **shared)
    yield a, b
    b.stop()
    a.stop()


@pytest.fixture
def agent_on_a(replicas):
    start, stop_all = agent_starter(replicas[0])
    yield start
    stop_all()


def _wait_for(what, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.02)
    return what()


def test_a_job_through_b_runs_on_an_agent_of_a_and_b_hears_its_end_at_once(replicas, agent_on_a):
    a, b = replicas
    assert a.services.bus.shared and b.services.bus.shared
    agent_on_a("a1")
    with Client(b.url, b.key("client")) as client:
        client.generate("echo", text="warm-up")  # the first job also pays canaries, warm-up
        took = []
        for i in range(5):
            t0 = time.monotonic()
            result = client.generate("echo", text=f"hello {i}")
            took.append(time.monotonic() - t0)
            assert result.json[0]["text"] == f"hello {i}"
    assert b.services.dispatcher.session_count() == 0  # nothing connected to B
    # Without the wake-up each took the 4-6 s quiet slice.
    assert max(took) < 1.5, took


def test_a_cancel_through_b_stops_the_job_on_the_agent_of_a_and_frees_its_slot(replicas,
                                                                             agent_on_a):
    a, b = replicas
    agent = agent_on_a("a1", slots=1)
    with Client(b.url, b.key("client")) as client:
        slow = client.jobs.create("echo", text="slow", sleep_ms=30000, steps=300)
        for ev in slow.events():
            if ev.kind == "progress":
                break
        slow.cancel()
        assert slow.refresh().state == "cancelled"
        # A's slot is free again: the next job runs (it never did before)
        t0 = time.monotonic()
        nxt = client.generate("echo", text="next", timeout=20)
        assert nxt.json[0]["text"] == "next" and time.monotonic() - t0 < 5
    session = a.services.dispatcher.session(agent.provider_id)
    assert _wait_for(lambda: not session.active)


def test_a_pause_through_b_applies_to_the_agent_on_a(replicas, agent_on_a):
    a, b = replicas
    agent = agent_on_a("a1")
    admin_b = b.services.admin
    admin_b.provider_action(agent.provider_id, "pause", "testing", by="t")
    session = a.services.dispatcher.session(agent.provider_id)
    assert _wait_for(lambda: session.paused, 5)
    with Client(b.url, b.key("client")) as client:
        job = client.jobs.create("echo", text="waits")
        time.sleep(1.0)
        assert job.refresh().state == "queued"  # paused: it gets no new job
        admin_b.provider_action(agent.provider_id, "resume", "done", by="t")
        assert job.wait(timeout=10).job.state == "settled"


def test_a_price_change_on_a_applies_on_b_at_once(replicas):
    a, b = replicas
    b.services.pricing.price("echo")  # cached on B
    a.services.pricing.set_price("echo", {"reserve_micro_per_unit": 777}, by="t")
    assert _wait_for(lambda: b.services.pricing.price("echo").reserve_micro_per_unit == 777,
                     1.0)


def _until_refused(url, key, body, timeout_s=6.0):
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        resp = httpx.post(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {key}"},
                          json=body)
        if resp.status_code == 409 or time.monotonic() > deadline:
            return resp
        time.sleep(0.3)


def test_admission_answers_alike_on_both_replicas(replicas, agent_on_a):
    a, b = replicas
    agent = agent_on_a("a1")
    # the canary measures θ (and writes it for B to read at once)
    assert _wait_for(lambda: a.services.market.theta(agent.provider_id, "echo")[1], 20)
    body = {"plugin": "echo", "inputs": {"text": "x"}, "max_price_micro": 10}
    key = b.key("client")
    on_a = _until_refused(a.url, key, body)
    on_b = _until_refused(b.url, key, body)
    assert (on_a.status_code, on_a.json().get("code")) == (409, "cannot_meet_terms")
    # B holds no agent: before, it admitted the job and it sat queued
    assert (on_b.status_code, on_b.json()["code"]) == (409, "cannot_meet_terms"), on_b.json()
    with Client(b.url, key) as client:  # terms the agent meets pass on B, and run on A
        job = client.jobs.create("echo", text="fair", terms={"max_price_micro": 10_000_000})
        assert job.wait(timeout=10).job.state == "settled"


def test_figures_outlive_the_broker_and_follow_the_agent_to_another_replica(replicas,
                                                                          agent_on_a):
    a, b = replicas
    agent = agent_on_a("a1")
    with Client(a.url, a.key("client")) as client:
        for i in range(3):
            client.generate("echo", text=f"{i}")
    theta_a = a.services.market.theta(agent.provider_id, "echo")
    assert theta_a[1]  # measured
    a.services.market.flush_figures()  # (the maintenance pass does it every interval)
    # B never held the agent: it reads the same figures when the agent connects there (the
    # market hears of a session about to be held)
    from broker.jobs.presence import AgentSession
    b.services.market.joining(AgentSession(provider_id=agent.provider_id, public_key="",
                                           account_id="op", plugins={"echo@1.0.0": ""}))
    assert b.services.market.theta(agent.provider_id, "echo") == pytest.approx(theta_a)
    rec = b.services.market.tracker.record_of(agent.provider_id, "echo")
    assert rec.successes >= 3


def test_the_size_the_weights_give_is_filled_in_alike_on_both_replicas(replicas):
    from tests.integration.test_weights_defaults_flow import README, _connect

    a, b = replicas
    raw = _connect(a, {"width": 64, "height": 64})  # an sd15 agent with tiny weights, on A
    try:
        with Client(b.url, b.key("client")) as client:
            assert _wait_for(lambda: client.request("GET", "/v1/plugins/sd15").json()[
                "input_defaults"] == {"width": 64, "height": 64}, 6)
            job = client.jobs.create("sd15", **README)  # B holds no agent
            assert (job.data["inputs"]["width"], job.data["inputs"]["height"]) == (64, 64)
    finally:
        raw.close()


def test_an_agent_moves_to_another_replica_and_its_lease_settles_once(replicas):
    import threading

    from plugins import builtin_plugin_dir
    from provider_agent.agent import Agent
    from provider_agent.config import AgentConfig
    from sdk.protocol.signing import KeyPair

    a, b = replicas
    cfg = AgentConfig(broker=f"{a.grpc},{b.grpc}", api_key=a.key("provider"), name="roamer",
                      slots=1, plugins=["echo"], device="cpu")
    agent = Agent(cfg, KeyPair.generate(), plugin_dirs={"echo": builtin_plugin_dir("echo")},
                  sandboxed=False, max_backoff_s=0.5)
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        assert _wait_for(lambda: a.services.dispatcher.session(agent.provider_id or "-"), 30)
        with Client(b.url, b.key("client")) as client:
            before = client.account()["available_micro"]
            job = client.jobs.create("echo", text="roams", sleep_ms=5000, steps=5)
            assert _wait_for(lambda: job.refresh().state == "running", 10)
            a.stop()  # A goes away mid-job: the agent reconnects to B with its lease
            assert _wait_for(lambda: b.services.dispatcher.session(agent.provider_id), 10)
            assert job.refresh().state == "running"  # still its lease: not requeued
            result = job.wait(timeout=20)
            assert result.job.state == "settled" and result.json[0]["text"] == "roams"
            events = [e.kind for e in job.events()]
            assert events.count("done") == 1 and "requeued" not in events, events
            paid = before - client.account()["available_micro"]
            assert paid > 0
            # a second job runs on B at once
            assert client.generate("echo", text="after", timeout=10).json[0]["text"] == "after"
    finally:
        agent.stop()
        t.join(10)
