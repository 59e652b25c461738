"""`sparecycles agent status` and `payout` against a live broker (issue #26): the JSON
document, and the live view in a real terminal (tmux; the screen is captured), which
follows the agent as its owner takes the GPU."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plugins import builtin_plugin_dir
from provider_agent.availability import FakeClock
from provider_agent.config import AgentConfig, save_config
from provider_agent.fleet import build_fleet
from provider_agent.gpu_usage import FakeGpuUsageSource, GpuProcess
from sdk import Client

from tests.integration.conftest import LiveBroker

SPARECYCLES = Path(sys.executable).parent / "sparecycles"


def cli(*args, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(SPARECYCLES), "agent", *args, "--home", str(home)],
                          capture_output=True, text=True, timeout=60)


def wait_for(predicate, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def machine(tmp_path):
    broker = LiveBroker(tmp_path)
    home = tmp_path / "home"
    cfg = AgentConfig(broker=broker.grpc, api_key=broker.key("provider"), name="den-pc",
                      plugins=["echo"], device="cuda:0", registry_url=broker.url,
                      idle_only=True, idle_resume_s=30)
    save_config(cfg, home)
    gpu = FakeGpuUsageSource()
    fleet = build_fleet(cfg, home=home, plugin_dirs={"echo": builtin_plugin_dir("echo")},
                        sandboxed=False, clock=FakeClock(), source=gpu, availability_poll_s=0.05)
    fleet.start()
    agent = fleet.agents[0]
    wait_for(lambda: agent.provider_id, what="the agent to connect")
    client = Client(broker.url, broker.key("client"))
    for i in range(3):
        client.jobs.create("echo", text=f"job {i}").wait(timeout=30)
    fleet.write_status()
    yield broker, home, fleet, gpu
    fleet.stop()
    fleet.wait(timeout_s=20)
    broker.stop()


def test_status_json_against_a_live_broker(machine):
    broker, home, fleet, gpu = machine
    out = cli("status", "--json", home=home)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["broker"]["reachable"] and not doc["broker"]["error"]
    assert doc["agent"]["running"] and doc["agent"]["pid"] == os.getpid()
    [dev] = doc["devices"]
    assert dev["device"] == "cuda:0" and dev["name"] == "den-pc" and dev["connected"]
    assert dev["provider_id"] == fleet.agents[0].provider_id
    assert dev["state"] == "ready"
    assert dev["jobs_today"]["settled"] >= 3 and dev["jobs_today"]["failed"] == 0
    assert dev["verification"]["standing"] in ("new", "good")
    c = doc["credits"]
    assert set(c) == {"pending_micro", "vesting_micro", "available_micro", "paid_out_micro"}
    assert c["vesting_micro"] > 0  # the settled jobs' share vests first
    # The owner takes the GPU: the agent says so, and so does the broker.
    gpu.set(0, processes=[GpuProcess(999, "blender", 1024)])
    wait_for(lambda: broker.services.providers.get(fleet.agents[0].provider_id)
             .availability.get("state") == "owner_active", what="the broker to see the owner")
    fleet.write_status()
    dev = json.loads(cli("status", "--json", home=home).stdout)["devices"][0]
    assert dev["state"] == "owner_active" and "blender (999)" in dev["reason"]
    assert dev["availability"]["available"] is False


def test_status_without_a_broker_says_so(machine, tmp_path):
    broker, home, fleet, gpu = machine
    out = subprocess.run([str(SPARECYCLES), "agent", "status", "--json", "--home", str(home),
                          "--url", "http://127.0.0.1:9"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    doc = json.loads(out.stdout)
    assert not doc["broker"]["reachable"] and "cannot reach the broker" in doc["broker"]["error"]
    assert doc["devices"][0]["state"] == "ready"  # the local half still shows


def test_payout_in_dev_mode_says_what_is_missing(machine):
    broker, home, fleet, gpu = machine
    out = cli("payout", "--credits", "1", home=home)
    assert out.returncode == 2
    assert out.stderr.startswith("error: ") and "payments_not_configured" in out.stderr
    bad = cli("payout", "--credits", "-3", home=home)
    assert bad.returncode == 2 and "positive number" in bad.stderr


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux missing: make system-deps")
def test_live_view_in_a_terminal(machine, tmp_path):
    broker, home, fleet, gpu = machine
    session = f"sc-status-{os.getpid()}"
    env = {"PATH": os.environ.get("PATH", ""), "TERM": "xterm-256color", "HOME": str(tmp_path)}
    subprocess.run(["tmux", "-L", session, "new-session", "-d", "-s", session, "-x", "180",
                    "-y", "50", f"{SPARECYCLES} agent status --interval 0.3 --home {home}"],
                   check=True, env=env)

    def screen_with(*words) -> str:
        text = subprocess.run(["tmux", "-L", session, "capture-pane", "-p", "-t", session],
                              capture_output=True, text=True, env=env).stdout
        return text if all(w in text for w in words) else ""
    try:
        text = wait_for(lambda: screen_with("credits", "den-pc", "settled"),
                        what="the live view")
        assert "connected" in text and "running (pid" in text
        assert "ready" in text and "3 settled" in text
        gpu.set(0, processes=[GpuProcess(999, "blender", 1024)])
        wait_for(lambda: fleet.agents[0].availability.state == "owner_active", what="paused")
        fleet.write_status()
        text = wait_for(lambda: screen_with("owner using the GPU"),
                        what="the view to follow the owner")
        assert "blender (999)" in text
        print(text)  # the captured screen, for whoever reads the test's output
    finally:
        subprocess.run(["tmux", "-L", session, "kill-server"], env=env)


def test_payout_through_stripe_connect(tmp_path):
    """With Stripe configured (a local stub of its API): `agent payout --all` pays every
    available credit, and `agent status --json` shows it paid."""
    import httpx

    from broker.ledger.seeding import seed_earned
    from tests.stripe_stub import SECRET_KEY, WEBHOOK_SECRET, StripeStub

    stub = StripeStub()
    broker = LiveBroker(tmp_path, stripe_secret_key=SECRET_KEY,
                        stripe_webhook_secret=WEBHOOK_SECRET, stripe_api_base=stub.url)
    try:
        key, who = broker.services.auth.create_account_with_key("provider")
        seed_earned(broker.services.ledger, who.account_id, 12_500_000, stake=False)
        home = tmp_path / "home"
        save_config(AgentConfig(broker=broker.grpc, api_key=key, registry_url=broker.url), home)
        nothing = cli("payout", "--credits", "0", home=home)
        assert nothing.returncode == 2 and "positive number" in nothing.stderr
        not_onboarded = cli("payout", "--all", home=home)
        assert not_onboarded.returncode == 2 and "onboard" in not_onboarded.stderr
        httpx.post(f"{broker.url}/v1/payouts/onboarding",
                   headers={"Authorization": f"Bearer {key}"}).raise_for_status()
        paid = cli("payout", "--all", home=home)
        assert paid.returncode == 0, paid.stderr
        assert "12.00 credits" in paid.stdout and "(paid)" in paid.stdout
        doc = json.loads(cli("status", "--json", home=home).stdout)
        assert doc["credits"]["paid_out_micro"] == 12_000_000
        assert doc["credits"]["available_micro"] == 500_000
        assert not doc["agent"]["running"] and "no agent has run here" in doc["agent"]["why"]
    finally:
        broker.stop()
        stub.close()


def test_cli_agent_outside_its_schedule_is_paused_and_status_says_so(tmp_path):
    """The real `sparecycles agent run` process, its schedule closed now: the broker sees
    it paused by schedule, `agent status --json` shows it, and SIGTERM stops it cleanly."""
    import signal
    from datetime import datetime, timedelta

    broker = LiveBroker(tmp_path)
    home = tmp_path / "home"
    save_config(AgentConfig(broker=broker.grpc, api_key=broker.key("provider"), name="cli-pc",
                            plugins=["echo"], device="cpu", registry_url=broker.url), home)
    later = datetime.now() + timedelta(hours=2)
    window = f"{later:%H}:00-{(later + timedelta(hours=1)):%H}:00"
    agent = subprocess.Popen([str(SPARECYCLES), "agent", "run", "--home", str(home),
                              "--no-sandbox", "--schedule", window],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def closed():
            for p in broker.services.providers.all():
                if p.name == "cli-pc" and (p.availability or {}).get("state") == "schedule_closed":
                    return p
            return None
        provider = wait_for(closed, timeout=60, what="the agent to connect paused")
        session = wait_for(lambda: broker.services.dispatcher.session(provider.id),
                           what="its session")
        assert session.free == 0
        doc = wait_for(lambda: (d := json.loads(cli("status", "--json", home=home).stdout))
                       ["agent"]["running"] and d, what="status.json")
        [dev] = doc["devices"]
        assert dev["state"] == "schedule_closed" and dev["connected"]
        assert dev["reason"] == "outside the schedule's windows"
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
        broker.stop()
