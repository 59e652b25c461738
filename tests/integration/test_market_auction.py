"""The auction through a live broker and four real (in-process) agents with different
asks and speeds: benchmarks, canaries, clearing, split batches, refusals up front."""
import threading
import time

import httpx
import pytest

from plugins import builtin_plugin_dir
from provider_agent.agent import Agent
from provider_agent.config import AgentConfig
from sdk import Client
from sdk.protocol.signing import KeyPair

# name: (ask micro/unit, throttle ms per unit). Echo's benchmark is 1 work unit.
AGENTS = {"fast-cheap": (200, 0), "slow-cheap": (200, 150), "fast-dear": (800, 0),
          "slow-dear": (900, 150)}


def _agent(broker, name, ask, throttle):
    cfg = AgentConfig(broker=broker.grpc, api_key=broker.key("provider"), name=name,
                      plugins=["echo"], device="cpu", asks={"echo": ask},
                      throttle_ms_per_unit={"echo": throttle} if throttle else {})
    agent = Agent(cfg, KeyPair.generate(), plugin_dirs={"echo": builtin_plugin_dir("echo")},
                  sandboxed=False)
    threading.Thread(target=agent.run, daemon=True).start()
    return agent


@pytest.fixture
def four(live_broker):
    agents = {n: _agent(live_broker, n, *v) for n, v in AGENTS.items()}
    market = live_broker.services.market
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ids = {n: a.provider_id for n, a in agents.items()}
        if all(ids.values()) and all(market.theta(p, "echo")[1] for p in ids.values()):
            break
        time.sleep(0.05)
    else:
        pytest.fail("agents were not measured by canaries in time")
    yield agents, ids
    for a in agents.values():
        a.stop()


def test_benchmark_and_canary_measure_the_emulated_speed(live_broker, four):
    agents, ids = four
    assert agents["slow-cheap"].benchmarks["echo"] < 10 < agents["fast-cheap"].benchmarks["echo"]
    market = live_broker.services.market
    assert market.theta(ids["slow-cheap"], "echo")[0] < 10 < market.theta(ids["fast-cheap"], "echo")[0]
    assert all(a.ask_status["echo"].accepted for a in agents.values())


def test_jobs_go_where_the_rule_says_and_pay_the_clearing_price(live_broker, four):
    agents, ids = four
    with Client(live_broker.url, live_broker.key("client")) as client:
        for priority in ("economy", "standard", "fast"):
            job = client.jobs.create("echo", text="x", terms={"priority": priority})
            job.wait(timeout=20)
            assert job.data["provider_id"] == ids["fast-cheap"], priority
            # Paid the critical ask against slow-cheap: between its ask and the reserve.
            assert 200 <= job.data["price_micro_per_unit"] <= 1_000
        result = client.generate("echo", text="split", n=4, timeout=30)
        assert len(result.outputs) == 4
        batch = client.request("GET", f"/v1/batches/{result.job.data['batch_id']}").json()
        assert batch["state"] == "settled"
        assert {j["provider_id"] for j in batch["jobs"]} == set(ids.values())


def test_terms_no_provider_can_meet_are_refused_up_front(live_broker, four):
    with Client(live_broker.url, live_broker.key("client")) as client:
        before = client.account()
        resp = httpx.post(f"{live_broker.url}/v1/jobs",
                          headers={"Authorization": f"Bearer {client.api_key}"},
                          json={"plugin": "echo", "inputs": {"text": "x"},
                                "max_price_micro": 10})
        assert resp.status_code == 409 and resp.json()["code"] == "cannot_meet_terms"
        assert "best achievable" in resp.json()["detail"].lower()
        assert client.jobs.list() == []
        assert client.account() == before


def test_asks_are_sealed(live_broker, four):
    agents, ids = four
    with Client(live_broker.url, live_broker.key("client")) as client:
        r = client._http.get("/v1/asks")
        assert r.status_code == 403
