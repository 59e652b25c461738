"""Money end to end: a real broker (REST + gRPC + maintenance) with the real stripe library
pointed at a local Stripe stub, and an in-process agent running echo. Buy credits, run jobs,
check every balance to the micro-credit, pay the provider out."""
import threading
import time

import httpx
import pytest

from broker.ledger.model import AccountKind
from sdk.client import Client
from sdk.errors import InsufficientCreditsError
from tests.stripe_stub import SECRET_KEY, WEBHOOK_SECRET, StripeStub, signed_event

from tests.integration.conftest import LiveBroker

MICRO = 1_000_000


@pytest.fixture
def money(tmp_path):
    stub = StripeStub()
    broker = LiveBroker(tmp_path, stripe_secret_key=SECRET_KEY, stripe_webhook_secret=WEBHOOK_SECRET,
                        stripe_api_base=stub.url, maintenance_interval_s=0.1)
    agents = []
    yield stub, broker, agents
    for agent, t in agents:
        agent.stop()
        t.join(10)
    broker.stop()
    stub.close()


def _start_agent(broker, key, agents):
    from plugins import builtin_plugin_dir
    from provider_agent.agent import Agent
    from provider_agent.config import AgentConfig
    from sdk.protocol.signing import KeyPair

    cfg = AgentConfig(broker=broker.grpc, api_key=key, name="earner", slots=1, plugins=["echo"],
                      device="cpu")
    agent = Agent(cfg, KeyPair.generate(), plugin_dirs={"echo": builtin_plugin_dir("echo")},
                  sandboxed=False)
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    agents.append((agent, t))
    deadline = time.monotonic() + 30
    while not agent.provider_id and time.monotonic() < deadline:
        time.sleep(0.02)
    assert agent.provider_id, "agent did not connect"


def _wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_buy_run_settle_vest_and_pay_out(money):
    stub, broker, agents = money
    svc = broker.services
    ckey, client_who = svc.auth.create_account_with_key("client")
    pkey, provider_who = svc.auth.create_account_with_key("provider")
    akey, _ = svc.auth.create_account_with_key("admin")
    http = httpx.Client(base_url=broker.url, timeout=10)
    # The admin prices echo: 2.5 credits per work unit, 10 % fee, vesting at once.
    r = http.put("/v1/admin/prices/echo", headers={"Authorization": f"Bearer {akey}"},
                 json={"reserve_micro_per_unit": 2_500_000, "fee_bps": 1_000,
                       "min_charge_micro": 100_000, "vesting_window_s": 0})
    assert r.status_code == 200, r.text

    _start_agent(broker, pkey, agents)  # a provider first: a job nobody could run is a 409
    with Client(broker.url, ckey) as client:
        # No credits yet: refused up front, no job.
        with pytest.raises(InsufficientCreditsError) as exc:
            client.generate("echo", text="too early")
        assert exc.value.body["shortfall_micro"] == 2_500_000
        assert svc.jobs.repo.counts_by_state() == {}

        # Buy 100 credits through Checkout; Stripe calls the webhook once paid.
        session = client.buy_credits(100)
        assert session["url"].startswith("https://checkout.stripe.test/")
        body, sig = signed_event("checkout.session.completed", stub.pay(session["id"]))
        for _ in range(2):  # Stripe delivers at least once
            hook = http.post("/v1/stripe/webhook", content=body,
                             headers={"Stripe-Signature": sig, "Content-Type": "application/json"})
            assert hook.status_code == 200 and hook.json()["result"] == "credited"
        assert client.account()["available_micro"] == 100 * MICRO

        quote = client.quote("echo", sleep_ms=500)
        assert (quote["expected_micro"], quote["max_micro"]) == (3_750_000, 3_750_000)

        assert client.generate("echo", text="a", timeout=60).json
        assert client.generate("echo", text="b", sleep_ms=500, timeout=60).json

        # Job a: 1 unit → 2.5 credits (fee 0.25); job b: 1.5 units → 3.75 (fee 0.375).
        acct = client.account()
        assert (acct["available_micro"], acct["held_micro"]) == (93_750_000, 0)
        lines = client.transactions()
        assert sum(t["amount_micro"] for t in lines if t["account"] == "available") == 93_750_000
        assert sum(t["amount_micro"] for t in lines if t["account"] == "held") == 0
        transactions = {(t["transaction_id"], t["kind"]) for t in lines}
        assert sorted(k for _, k in transactions) == ["deposit", "hold", "hold", "post", "post"]

    provider = provider_who.account_id
    _wait_for(lambda: svc.ledger.balances(provider)[AccountKind.PROVIDER_AVAILABLE] == 5_625_000)
    assert svc.ledger.balances(provider)[AccountKind.PROVIDER_VESTING] == 0
    assert svc.ledger.balances("platform")[AccountKind.PLATFORM_FEES] == 625_000

    # Pay the provider out through Stripe Connect: onboarding, then a 5-credit transfer.
    auth = {"Authorization": f"Bearer {pkey}"}
    link = http.post("/v1/payouts/onboarding", headers=auth).json()
    assert link["url"].endswith(link["account"])
    payout = http.post("/v1/payouts", json={"credits": 5}, headers=auth)
    assert payout.status_code == 201 and payout.json()["status"] == "paid", payout.text
    assert stub.transfers[payout.json()["transfer_id"]]["amount"] == 5  # cents
    acct = http.get("/v1/account", headers=auth).json()
    assert (acct["available_micro"], acct["vesting_micro"], acct["paid_out_micro"]) == (
        625_000, 0, 5_000_000)

    platform = svc.ledger.balances("platform")
    assert platform[AccountKind.PLATFORM_PAYMENT_CLEARING] == -100 * MICRO + 5 * MICRO
    assert platform[AccountKind.PLATFORM_FEES] == 625_000
    client_total = sum(svc.ledger.balances(client_who.account_id).values())
    assert client_total + 625_000 + 625_000 + 5 * MICRO == 100 * MICRO
    assert svc.ledger.verify().ok
