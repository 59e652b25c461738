"""Idle-only mode against a live broker (issue #26): a fake GPU-usage source behind the
NVML interface and a fake clock drive a real agent; the broker sees it paused, not failed.
"""
from __future__ import annotations

import time

import pytest

from provider_agent.availability import (IDLE_WAITING, OWNER_ACTIVE, FakeClock, Gate,
                                         UsageMeter)
from provider_agent.config import AgentConfig
from provider_agent.gpu_usage import FakeGpuUsageSource, GpuProcess
from sdk import Client

from tests.integration.conftest import LiveBroker, agent_starter


def wait_for(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def world(tmp_path):
    broker = LiveBroker(tmp_path, checkpoint_min_steps=4)
    start, stop_all = agent_starter(broker)
    yield broker, start
    stop_all()
    broker.stop()


def owner_gate(on_owner: str, clock: FakeClock, gpu: FakeGpuUsageSource, **terms) -> Gate:
    rules = AgentConfig(api_key="k", idle_only=True, idle_resume_s=60, on_owner=on_owner,
                        **terms).rules()
    return Gate(rules, device="cuda:0", gpu_index=0, clock=clock, source=gpu,
                meter=UsageMeter())


def availability(broker, agent) -> dict:
    return broker.services.providers.get(agent.provider_id).availability


def state(broker, job_id):
    return broker.services.jobs.repo.get(job_id)


def settled(broker, job, timeout) -> bool:
    job.wait(timeout=timeout)
    return state(broker, job.id).state.value == "settled"


def failures(broker, agent) -> int:
    return broker.services.market.tracker.record_of(agent.provider_id, "echo").failures


OWNER = [GpuProcess(31337, "blender", 2048.0)]


@pytest.mark.parametrize("policy", ["finish", "give_back", "checkpoint"])
def test_owner_pauses_the_agent_and_idle_time_resumes_it(world, policy):
    broker, start = world
    clock, gpu = FakeClock(), FakeGpuUsageSource()
    agent = start("gaming-pc", gate=owner_gate(policy, clock, gpu))
    wait_for(lambda: availability(broker, agent).get("available") is True, what="available")
    client = Client(broker.url, broker.key("client"))

    running = client.jobs.create("echo", text="long", sleep_ms=1600, steps=16)
    wait_for(lambda: agent.running, what="the job to start")
    time.sleep(0.25)  # a checkpoint or two (every 3 steps of 100 ms)
    t0 = time.monotonic()
    gpu.set(0, processes=OWNER, utilisation_pct=90)
    seen = wait_for(lambda: (a := availability(broker, agent)).get("state") == OWNER_ACTIVE
                    and a, what="the broker to see the owner")
    assert time.monotonic() - t0 < 2.0, "stops asking within seconds"
    assert seen["available"] is False and "blender (31337)" in seen["reason"]
    assert broker.services.dispatcher.session(agent.provider_id).free == 0

    if policy == "finish":
        assert settled(broker, running, 20)
        assert state(broker, running.id).attempt == 0
    else:
        # Given back (after a fresh checkpoint for "checkpoint") and requeued, not failed.
        wait_for(lambda: state(broker, running.id).state.value == "queued", timeout=10,
                 what="the job to be given back")
        assert state(broker, running.id).attempt == 1

    queued = client.jobs.create("echo", text="while the owner plays")
    time.sleep(0.5)
    assert state(broker, queued.id).state.value == "queued"  # no new work while paused

    gpu.set(0, processes=[], utilisation_pct=0)
    wait_for(lambda: availability(broker, agent).get("state") == IDLE_WAITING,
             what="idle-waiting")
    time.sleep(0.3)
    assert state(broker, queued.id).state.value == "queued"  # not before idle_resume_s
    clock.advance(61)
    wait_for(lambda: availability(broker, agent).get("available") is True, what="resumed")
    assert settled(broker, queued, 20)
    assert settled(broker, running, 30)
    if policy == "checkpoint":
        resumed = [e for e in broker.services.jobs.repo.events_after(running.id, 0)
                   if e.kind == "progress" or e.kind == "running"]
        assert resumed  # ran again
        assert state(broker, running.id).attempt == 1
    # Nothing of this counts against the provider.
    assert failures(broker, agent) == 0
    assert broker.services.admin.queries.provider_stats(agent.provider_id)["failed"] == 0


def test_a_job_sent_while_paused_goes_back_uncounted(world):
    """The race: the broker assigns a job just before it hears the agent stopped."""
    broker, start = world
    clock, gpu = FakeClock(), FakeGpuUsageSource()
    agent = start("laptop", gate=owner_gate("give_back", clock, gpu), poll_s=3600)
    wait_for(lambda: availability(broker, agent).get("available") is True, what="available")
    gpu.set(0, processes=OWNER)
    agent.look()
    # The broker has not handled the message yet when a job comes: pretend by marking
    # the session available again on the broker's side.
    wait_for(lambda: availability(broker, agent).get("available") is False, what="paused")
    broker.services.dispatcher.session(agent.provider_id).unavailable = ""
    job = Client(broker.url, broker.key("client")).jobs.create("echo", text="race")
    wait_for(lambda: state(broker, job.id).attempt >= 1, what="the give-back")
    broker.services.dispatcher.session(agent.provider_id).unavailable = OWNER_ACTIVE
    wait_for(lambda: state(broker, job.id).state.value == "queued", what="requeued")
    assert failures(broker, agent) == 0
    assert broker.services.admin.queries.provider_stats(agent.provider_id)["failed"] == 0


def test_schedule_closed_agent_is_paused_not_failed(world):
    broker, start = world
    from datetime import datetime, timezone

    noon = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc).timestamp()
    clock = FakeClock(now=noon, zone=timezone.utc)
    rules = AgentConfig(api_key="k", schedule=["22:00-07:00"]).rules()
    gate = Gate(rules, device="cpu", gpu_index=None, clock=clock,
                source=FakeGpuUsageSource(), meter=UsageMeter())
    agent = start("night-owl", gate=gate)
    wait_for(lambda: availability(broker, agent).get("state") == "schedule_closed",
             what="closed")
    job = Client(broker.url, broker.key("client")).jobs.create("echo", text="at night")
    time.sleep(0.4)
    assert state(broker, job.id).state.value == "queued"
    # The admin console shows it paused by its owner's terms, not failed.
    import html

    from broker.app import create_app
    from tests.integration.test_admin_console_forms import _sign_in

    console = create_app(broker.services).test_client()
    _sign_in(console, broker.services)
    page = html.unescape(console.get(f"/admin/providers/{agent.provider_id}")
                         .get_data(as_text=True))
    assert "paused by its owner's terms: schedule closed" in page
    assert "paused: schedule closed" in html.unescape(
        console.get("/admin/providers").get_data(as_text=True))
    clock.advance(10 * 3600)  # 22:00
    assert settled(broker, job, 20)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("for_owner,said_unavailable,failed", [
    (True, True, 0), (False, True, 1), (True, False, 1)])
def test_a_canary_given_back_for_the_owner_is_not_a_failure(world, for_owner,
                                                            said_unavailable, failed):
    """The broker's canary (a measuring job) given back for the owner, after the agent
    said it takes no work, counts against nobody; given back for any other reason it
    still counts, as before, and so does one "for the owner" from an agent that never
    said its owner came back (issue #20: else it refuses canaries for free)."""
    import json

    from sdk.protocol import agent_pb2 as pb
    from sdk.protocol.envelope import challenge_document
    from sdk.protocol.signing import KeyPair
    from tests.integration.test_gateway_and_sdk import RawAgent

    broker, _ = world
    raw = RawAgent(broker.grpc, broker.key("provider"))
    key = KeyPair.generate()
    raw.send(hello=pb.Hello(public_key=key.public_key_hex, name="raw"))
    ch = raw.recv().challenge
    raw.send(challenge_response=pb.ChallengeResponse(signature=key.sign(
        "challenge", challenge_document(ch.nonce, key.public_key_hex, ch.broker_public_key))))
    raw.send(capabilities=pb.Capabilities(  # a benchmark claim: the broker checks it
        plugins=[pb.PluginCapability(name="echo", version="1.0.0")], slots=1, sandboxed=True,
        benchmarks=[pb.PluginBenchmark(plugin="echo", units_per_s=50.0, runs=3)]))
    provider_id = raw.recv().welcome.provider_id
    msg = raw.recv()
    while msg.WhichOneof("body") != "assignment":
        msg = raw.recv()
    canary = json.loads(msg.assignment.envelope)
    assert broker.services.canaries.owns(canary["job_id"])
    if said_unavailable:  # the owner came back: the agent says so first, as agents do
        raw.send(availability=pb.Availability(available=False, state="owner_active",
                                              reason="the owner started a game"))
    raw.send(give_back=pb.GiveBack(job_id=canary["job_id"], attempt=canary["attempt"],
                                   reason="the owner started a game", for_owner=for_owner))
    while (msg := raw.recv()).WhichOneof("body") != "ack":
        pass
    assert msg.ack.what == "give_back"
    assert not broker.services.canaries.owns(canary["job_id"])
    rec = broker.services.market.tracker.record_of(provider_id, "echo")
    assert rec.failures == failed
    raw.close()


def test_min_price_floors_the_standing_ask(world):
    broker, start = world
    agent = start("proud", asks={"echo": 100}, min_price_micro_per_unit=500)
    wait_for(lambda: agent.ask_status.get("echo"), what="the ask's answer")
    [row] = [r for r in broker.services.market.asks({agent.provider_id}) if r["plugin"] == "echo"]
    assert row["price_micro_per_unit"] == 500 and not row["at_reserve"]
    agent.post_asks({"echo": 200})  # a later ask under the floor is lifted too
    wait_for(lambda: agent.ask_status["echo"].standing_price_micro_per_unit == 500,
             what="the lifted ask")


def test_bad_terms_on_the_command_line_are_refused_before_anything_starts(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from provider_agent.config import save_config

    save_config(AgentConfig(api_key="k"), tmp_path)
    exe = Path(sys.executable).parent / "sparecycles"
    for flags, words in ((["--schedule", "nightly"], "is not a time window"),
                         (["--max-temperature", "500"], "max_temperature_c is 500.0"),
                         (["--devices", "gpu0"], "devices is ['gpu0']")):
        out = subprocess.run([str(exe), "agent", "run", "--home", str(tmp_path), "--no-sandbox",
                              *flags], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and words in out.stderr, (flags, out.stderr)
