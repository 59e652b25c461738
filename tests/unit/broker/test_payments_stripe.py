"""Stripe Checkout, the webhook and Connect payouts through the real Flask app and the real
``stripe`` library, against a local HTTP stub of Stripe (tests/stripe_stub.py)."""
import time

import pytest

from broker.app import create_app
from broker.ledger.model import AccountKind
from broker.services import build_services
from broker.settings import Settings
from tests.stripe_stub import SECRET_KEY, WEBHOOK_SECRET, StripeStub, signed_event

MICRO = 1_000_000
WEBHOOK = "/v1/stripe/webhook"


@pytest.fixture
def stub():
    s = StripeStub()
    yield s
    s.close()


@pytest.fixture
def world(tmp_path, stub):
    services = build_services(Settings(data_dir=tmp_path, stripe_secret_key=SECRET_KEY,
                                       stripe_webhook_secret=WEBHOOK_SECRET,
                                       stripe_api_base=stub.url, maintenance_interval_s=0))
    app = create_app(services)
    key, who = services.auth.create_account_with_key("client")
    client = app.test_client()
    client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {key}"
    yield client, services, who.account_id
    services.engine.dispose()


def _available(services, account):
    return services.ledger.balances(account).get(AccountKind.CLIENT_AVAILABLE, 0)


def _checkout(client, credits=500):
    resp = client.post("/v1/credits/checkout", json={"credits": credits})
    assert resp.status_code == 201, resp.json
    return resp.json


def _deliver(client, event_type, obj, **kw):
    body, sig = signed_event(event_type, obj, **kw)
    return client.post(WEBHOOK, data=body, headers={"Stripe-Signature": sig,
                                                     "Content-Type": "application/json",
                                                     "Authorization": ""})


def test_checkout_returns_the_session_url_and_mode(world, stub):
    client, services, account = world
    body = _checkout(client, 500)
    assert body["url"] == f"https://checkout.stripe.test/c/pay/{body['id']}"
    assert body["amount_cents"] == 500 and body["currency"] == "usd"
    session = stub.sessions[body["id"]]
    assert session["metadata"] == {"sparecycles_account": account, "credits": "500"}
    assert _available(services, account) == 0  # nothing until Stripe says it is paid
    resp = client.get("/v1/account")
    assert resp.json["funding"] == "stripe" and resp.headers["X-Sparecycles-Funding"] == "stripe"


@pytest.mark.parametrize("credits", [0, -5, 2.5, "10", None, True])
def test_checkout_refuses_bad_amounts(world, credits):
    client, _, _ = world
    resp = client.post("/v1/credits/checkout", json={"credits": credits})
    assert resp.status_code == 400 and resp.json["code"] == "invalid_amount"


def test_good_event_credits_once_after_refetching_the_session(world, stub):
    client, services, account = world
    session = _checkout(client, 500)
    paid = stub.pay(session["id"])
    resp = _deliver(client, "checkout.session.completed", paid, event_id="evt_1")
    assert resp.status_code == 200 and resp.json["result"] == "credited"
    assert _available(services, account) == 500 * MICRO
    assert ("GET", f"/v1/checkout/sessions/{session['id']}") in stub.requests
    # Duplicate delivery of the same event: same answer, no second credit.
    again = _deliver(client, "checkout.session.completed", paid, event_id="evt_1")
    assert again.status_code == 200 and again.json["transaction"] == resp.json["transaction"]
    assert _available(services, account) == 500 * MICRO
    hist = client.get("/v1/account/transactions").json["data"]
    assert [(t["kind"], t["amount_micro"]) for t in hist] == [("deposit", 500 * MICRO)]


def test_forged_and_stale_signatures_are_refused_and_change_nothing(world, stub):
    client, services, account = world
    paid = stub.pay(_checkout(client)["id"])
    forged = _deliver(client, "checkout.session.completed", paid, secret="whsec_attacker")
    assert forged.status_code == 400 and forged.json["code"] == "webhook_refused"
    stale = _deliver(client, "checkout.session.completed", paid,
                     timestamp=int(time.time()) - 600)
    assert stale.status_code == 400 and "timestamp" in stale.json["detail"].lower()
    unsigned = client.post(WEBHOOK, data=b"{}", headers={"Content-Type": "application/json"})
    assert unsigned.status_code == 400
    # A body altered after signing (amount bumped) fails too: the signature is on raw bytes.
    body, sig = signed_event("checkout.session.completed", paid)
    tampered = body.replace(b'"amount_total": 500', b'"amount_total": 99999')
    assert tampered != body
    resp = client.post(WEBHOOK, data=tampered, headers={"Stripe-Signature": sig})
    assert resp.status_code == 400
    assert _available(services, account) == 0
    assert services.ledger.verify().ok


def test_out_of_order_and_async_events_credit_the_session_exactly_once(world, stub):
    client, services, account = world
    sid = _checkout(client, 300)["id"]
    # A delayed payment method: "completed" arrives while the session is still unpaid.
    early = _deliver(client, "checkout.session.completed", dict(stub.sessions[sid]), event_id="evt_a")
    assert early.json["result"] == "not_paid_yet" and _available(services, account) == 0
    stub.pay(sid)
    # The async success; then a late redelivery of "completed" whose copy still says unpaid:
    # the broker re-fetches the session, sees it paid, and recognises it as already credited.
    ok = _deliver(client, "checkout.session.async_payment_succeeded", stub.sessions[sid],
                  event_id="evt_b")
    assert ok.json["result"] == "credited"
    late = _deliver(client, "checkout.session.completed", {**stub.sessions[sid],
                                                          "payment_status": "unpaid"},
                    event_id="evt_a")
    assert late.json["transaction"] == ok.json["transaction"]
    assert _available(services, account) == 300 * MICRO


def test_async_success_before_completed_is_tolerated(world, stub):
    client, services, account = world
    sid = _checkout(client, 200)["id"]
    stub.pay(sid)
    first = _deliver(client, "checkout.session.async_payment_succeeded", stub.sessions[sid])
    second = _deliver(client, "checkout.session.completed", stub.sessions[sid])
    assert first.json["result"] == second.json["result"] == "credited"
    assert _available(services, account) == 200 * MICRO


def test_event_for_a_foreign_or_unknown_session_credits_nothing(world, stub):
    client, services, account = world
    missing = _deliver(client, "checkout.session.completed", {"id": "cs_nope"})
    assert missing.status_code == 502  # Stripe will retry; nothing written
    other = _deliver(client, "payment_intent.created", {"id": "pi_1"})
    assert other.status_code == 200 and other.json["result"] == "ignored"
    assert _available(services, account) == 0


def test_grants_are_refused_when_stripe_is_configured(world):
    client, services, account = world
    admin_key, _ = services.auth.create_account_with_key("admin")
    resp = client.post("/v1/admin/grants", json={"account_id": account, "credits": 5},
                       headers={"Authorization": f"Bearer {admin_key}"})
    assert resp.status_code == 409 and resp.json["code"] == "not_dev_funding"


def _provider_with_available(services, micro):
    """A provider account holding ``micro`` vested credits (a settled, vested job's worth)."""
    key, who = services.auth.create_account_with_key("provider")
    services.ledger.open_client("payer")
    services.ledger.deposit("payer", micro, idempotency_key="seed", source=__import__(
        "broker.ledger.model", fromlist=["FundingSource"]).FundingSource.PAYMENT)
    from broker.ledger.model import Splits
    hold = services.ledger.hold("payer", micro, "job-seed", idempotency_key="seed-hold")
    services.ledger.post(hold.id, Splits(who.account_id, micro), idempotency_key="seed-post",
                         vesting_window_s=0)
    services.ledger.vest(who.account_id)
    return key, who.account_id


def test_connect_onboarding_then_payout_then_failed_transfer_is_reversed(world, stub):
    client, services, _ = world
    key, provider = _provider_with_available(services, 30 * MICRO)
    auth = {"Authorization": f"Bearer {key}"}
    early = client.post("/v1/payouts", json={"credits": 1}, headers=auth)
    assert early.status_code == 409 and early.json["code"] == "payout_account_missing"
    link = client.post("/v1/payouts/onboarding", headers=auth)
    assert link.status_code == 201
    assert link.json["url"] == f"https://connect.stripe.test/setup/{link.json['account']}"
    # The same account on a second onboarding call (a new link, no second Connect account).
    assert client.post("/v1/payouts/onboarding", headers=auth).json["account"] == link.json["account"]
    assert len(stub.accounts) == 1

    paid = client.post("/v1/payouts", json={"credits": 10}, headers={**auth, "Idempotency-Key": "p1"})
    assert paid.status_code == 201 and paid.json["status"] == "paid", paid.json
    transfer = stub.transfers[paid.json["transfer_id"]]
    assert transfer["amount"] == 10 and transfer["destination"] == link.json["account"]
    retried = client.post("/v1/payouts", json={"credits": 10}, headers={**auth, "Idempotency-Key": "p1"})
    assert retried.json["id"] == paid.json["id"] and len(stub.transfers) == 1
    acct = client.get("/v1/account", headers=auth).json
    assert acct["available_micro"] == 20 * MICRO and acct["paid_out_micro"] == 10 * MICRO

    too_much = client.post("/v1/payouts", json={"credits": 21}, headers=auth)
    assert too_much.status_code == 402
    odd = client.post("/v1/payouts", json={"amount_micro": 1_500_000}, headers=auth)
    assert odd.status_code == 400 and odd.json["code"] == "invalid_amount"

    stub.fail_transfers = True
    failed = client.post("/v1/payouts", json={"credits": 5}, headers=auth)
    assert failed.status_code == 502 and "reversed" in failed.json["detail"]
    assert services.ledger.balances(provider)[AccountKind.PROVIDER_AVAILABLE] == 20 * MICRO
    payouts = client.get("/v1/payouts", headers=auth).json["data"]
    assert sorted(p["status"] for p in payouts) == ["failed", "paid"]
    assert services.ledger.verify().ok


def test_transfer_reversed_event_returns_the_credits(world, stub):
    client, services, _ = world
    key, provider = _provider_with_available(services, 10 * MICRO)
    auth = {"Authorization": f"Bearer {key}"}
    client.post("/v1/payouts/onboarding", headers=auth)
    paid = client.post("/v1/payouts", json={"credits": 10}, headers=auth).json
    assert services.ledger.balances(provider)[AccountKind.PROVIDER_AVAILABLE] == 0
    for _ in range(2):  # repeated delivery reverses once
        resp = _deliver(client, "transfer.reversed", stub.transfers[paid["transfer_id"]])
        assert resp.status_code == 200
    assert services.ledger.balances(provider)[AccountKind.PROVIDER_AVAILABLE] == 10 * MICRO
