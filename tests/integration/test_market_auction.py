"""The auction through a live broker and four real (in-process) agents with different
asks and speeds: benchmarks, canaries, clearing, split batches, refusals up front."""
import threading
import time

import httpx
import pytest

from plugins import builtin_plugin_dir
from provider_agent.agent import Agent
from provider_agent.config import AgentConfig
from sdk import Client, PermissionDeniedError
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
        with pytest.raises(PermissionDeniedError):
            client.request("GET", "/v1/asks")


def test_a_pinned_build_runs_only_on_agents_with_its_weights(live_broker, tmp_path):
    """The catalog lists echo's weights: the agent holding them wins every job; a cheaper
    agent with other weights never does, cold market or not."""
    import dataclasses
    import hashlib

    from sdk.protocol.manifest import WeightFile

    data = b"the published weights"
    catalog = live_broker.services.catalog
    catalog.add(dataclasses.replace(catalog.get("echo", "1.0.0"), weights=(
        WeightFile("model.bin", hashlib.sha256(data).hexdigest(), len(data)),)))
    folders = {}
    for name, content in (("right", data), ("wrong", b"some other weights")):
        folders[name] = tmp_path / f"weights-{name}"
        folders[name].mkdir()
        (folders[name] / "model.bin").write_bytes(content)
    agents = {}
    for name, ask in (("right", 900), ("wrong", 100)):
        cfg = AgentConfig(broker=live_broker.grpc, api_key=live_broker.key("provider"),
                          name=name, plugins=["echo"], device="cpu", asks={"echo": ask},
                          weights={"echo": str(folders[name])})
        agents[name] = Agent(cfg, KeyPair.generate(),
                             plugin_dirs={"echo": builtin_plugin_dir("echo")}, sandboxed=False)
        threading.Thread(target=agents[name].run, daemon=True).start()
    try:
        deadline = time.monotonic() + 30
        while not all(a.provider_id for a in agents.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        right, wrong = agents["right"].provider_id, agents["wrong"].provider_id
        with Client(live_broker.url, live_broker.key("client")) as client:
            for _ in range(4):
                job = client.jobs.create("echo", text="x")
                job.wait(timeout=20)
                assert job.data["provider_id"] == right
        rows = {r["provider_id"]: r for r in live_broker.services.market.asks()}
        assert rows[right]["weights_digest"] != rows[wrong]["weights_digest"]
    finally:
        for a in agents.values():
            a.stop()


def test_admins_set_the_reputation_floor_and_providers_see_only_their_asks(live_broker):
    admin = {"Authorization": f"Bearer {live_broker.key('admin')}"}
    provider = {"Authorization": f"Bearer {live_broker.key('provider')}"}
    url = f"{live_broker.url}/v1/admin/market"
    assert httpx.get(url, headers=admin).json()["reputation_floor"] == 0.5
    r = httpx.put(url, headers=admin, json={"reputation_floor": 0.7})
    assert r.status_code == 200 and r.json()["reputation_floor"] == 0.7
    assert live_broker.services.market.rules.reputation_floor == 0.7
    bad = httpx.put(url, headers=admin, json={"reputation_floor": 2})
    assert bad.status_code == 422 and bad.json()["code"] == "invalid_market_rule"
    assert httpx.put(url, headers=admin, json={"floor": 0.1}).status_code == 400
    assert httpx.put(url, headers=provider, json={"reputation_floor": 0.0}).status_code == 403
    assert httpx.get(url, headers=provider).status_code == 403
    assert live_broker.services.market.rules.reputation_floor == 0.7
    # Stored and audited.
    assert live_broker.services.market.store.load_rules() == {"reputation_floor": 0.7}
    [entry] = live_broker.services.audit.search(subject="market:reputation_floor",
                                                action="market.set")
    assert entry.data == {"before": 0.5, "after": 0.7} and entry.actor.startswith("admin:")


def test_the_greeting_answers_what_the_agent_offered_with_its_connection(live_broker):
    """One call on connect (the dispatcher holds the session; the market hears of it with
    the agent's benchmarks and asks): an impossible benchmark is refused, each ask answered."""
    from sdk.protocol import agent_pb2 as pb
    from sdk.protocol.envelope import challenge_document

    from tests.integration.test_gateway_and_sdk import RawAgent

    raw, key = RawAgent(live_broker.grpc, live_broker.key("provider")), KeyPair.generate()
    try:
        raw.send(hello=pb.Hello(public_key=key.public_key_hex, name="raw"))
        ch = raw.recv().challenge
        raw.send(challenge_response=pb.ChallengeResponse(signature=key.sign(
            "challenge", challenge_document(ch.nonce, key.public_key_hex,
                                            ch.broker_public_key))))
        raw.send(capabilities=pb.Capabilities(
            plugins=[pb.PluginCapability(name="echo", version="1.0.0")], slots=2,
            sandboxed=True, benchmarks=[pb.PluginBenchmark(plugin="echo", units_per_s=-1.0)],
            asks=[pb.StandingAsk(plugin="echo", price_micro_per_unit=500),
                  pb.StandingAsk(plugin="sd15", price_micro_per_unit=500)]))
        pid = raw.recv().welcome.provider_id
        assert pid
        refusal = raw.recv().refusal
        assert refusal.code == "invalid_benchmark"
        accepted, refused = raw.recv().ask_status, raw.recv().ask_status
        assert (accepted.plugin, accepted.accepted, accepted.standing_price_micro_per_unit) \
            == ("echo", True, 500)
        assert (refused.plugin, refused.accepted, refused.code) == \
            ("sd15", False, "plugin_not_served")
        market = live_broker.services.market
        [row] = market.asks({pid})
        assert row["online"] and row["price_micro_per_unit"] == 500
        assert market.presence.get(pid).free == 2  # slots: the presence's
    finally:
        raw.close()
