"""Jobs and money through the real wiring (SQLite): the hold at submit, the split at
settlement to the micro-credit, refunds on cancel and failure, idempotent resubmits, quotes."""
import pytest

from broker.app import create_app
from broker.errors import IdempotencyConflict
from broker.ledger.model import AccountKind, HoldState
from sdk.protocol.canonical import canonical_bytes, loads, sha256_hex
from sdk.protocol.envelope import make_receipt

from broker_fixtures import echo_world
from broker.api.job_request import job_request

MICRO = 1_000_000
C, P, PLATFORM = AccountKind.CLIENT_AVAILABLE, AccountKind.PROVIDER_VESTING, "platform"


@pytest.fixture
def world(tmp_path):
    # echo: 1 + sleep_ms/1000 work units at 0.25 credit each, 10 % fee, 0.1 credit minimum
    services, client, prov_acct, session, key = echo_world(tmp_path)
    yield services, client, prov_acct, session, key
    services.engine.dispose()


def _bal(services, owner, kind):
    return services.ledger.balances(owner).get(kind, 0)


def _run(services, job, session, key, work_units):
    assert services.dispatcher.match_once() == 1
    env_bytes, _ = session.sent[-1]
    env = loads(env_bytes)
    services.jobs.accepted(session.provider_id, job.id, env["attempt"])
    data = b'{"ok":true}'
    sha = services.jobs.store_output(session.provider_id, job.id, env["attempt"], data,
                                     sha256_hex(data))
    rec = make_receipt(envelope=env, envelope_bytes=env_bytes, provider_key=key.public_key_hex,
                       outputs=[{"index": 0, "sha256": sha, "media_type": "application/json",
                                 "size": len(data)}], work_units=work_units, timings_ms={"run": 1})
    return services.jobs.receipt(session.provider_id, key.public_key_hex, canonical_bytes(rec),
                                 key.sign("receipt", rec))


def test_submit_without_credits_is_402_naming_the_shortfall_and_creates_no_job(world):
    services, client, *_ = world
    services.payments.grant(client.account_id, 300_000, by="test")  # 0.3 credit
    app = create_app(services).test_client()
    key, _ = services.auth.add_key(client.account_id, "client")
    resp = app.post("/v1/jobs", json={"plugin": "echo", "inputs": {"sleep_ms": 1000}},
                    headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 402
    body = resp.json
    assert body["code"] == "insufficient_credits"
    assert (body["needed_micro"], body["available_micro"], body["shortfall_micro"]) == (
        500_000, 300_000, 200_000)
    assert "0.2 credits short" in body["detail"] and "grant" in body["detail"]
    assert services.jobs.repo.counts_by_state() == {}
    assert _bal(services, client.account_id, C) == 300_000
    assert _bal(services, client.account_id, AccountKind.CLIENT_HELD) == 0


def test_settlement_splits_to_the_micro_credit(world):
    services, client, prov, session, key = world
    services.payments.grant(client.account_id, 10 * MICRO, by="test")
    job, created = services.jobs.submit(client, job_request({"plugin": "echo", "inputs": {"sleep_ms": 1234}}, services.jobs.catalog))
    # Hold: 2.234 units × 250,000 = 558,500
    assert created and job.max_price_micro == 558_500
    assert _bal(services, client.account_id, C) == 10 * MICRO - 558_500
    assert _bal(services, client.account_id, AccountKind.CLIENT_HELD) == 558_500
    settled = _run(services, job, session, key, work_units=1.5)
    assert settled.state.value == "settled"
    # Charge 1.5 × 250,000 = 375,000; fee 10 % = 37,500; provider 337,500; rest released.
    assert _bal(services, client.account_id, C) == 10 * MICRO - 375_000
    assert _bal(services, client.account_id, AccountKind.CLIENT_HELD) == 0
    assert _bal(services, prov.account_id, P) == 337_500
    assert _bal(services, PLATFORM, AccountKind.PLATFORM_FEES) == 37_500
    hold = services.ledger.get_hold(job.hold_id)
    assert hold.state is HoldState.POSTED and hold.vests_at is not None
    assert services.ledger.verify().ok


def test_minimum_charge_and_cap_at_the_hold(world):
    services, client, prov, session, key = world
    services.payments.grant(client.account_id, 10 * MICRO, by="test")
    job, _ = services.jobs.submit(client, job_request({"plugin": "echo", "inputs": {}}, services.jobs.catalog))
    assert job.max_price_micro == 250_000
    _run(services, job, session, key, work_units=0.1)  # 25,000 < minimum 100,000
    assert _bal(services, client.account_id, C) == 10 * MICRO - 100_000
    job2, _ = services.jobs.submit(client, job_request({"plugin": "echo", "inputs": {}}, services.jobs.catalog))
    _run(services, job2, session, key, work_units=50)  # claims far more than the hold
    assert _bal(services, client.account_id, C) == 10 * MICRO - 100_000 - 250_000
    assert _bal(services, prov.account_id, P) == 90_000 + 225_000
    assert _bal(services, PLATFORM, AccountKind.PLATFORM_FEES) == 10_000 + 25_000


def test_cancel_before_run_and_failure_refund_everything(world):
    services, client, prov, session, key = world
    services.payments.grant(client.account_id, MICRO, by="test")
    queued, _ = services.jobs.submit(client, job_request({"plugin": "echo", "inputs": {}}, services.jobs.catalog))
    services.jobs.cancel(client, queued.id)
    assert _bal(services, client.account_id, C) == MICRO
    assert services.ledger.get_hold(queued.hold_id).state is HoldState.VOIDED
    doomed, _ = services.jobs.submit(client, job_request({"plugin": "echo", "inputs": {}}, services.jobs.catalog))
    services.dispatcher.match_once()
    services.jobs.failed(session.provider_id, doomed.id, 0, "oom", "out of memory", retryable=False)
    assert _bal(services, client.account_id, C) == MICRO
    assert _bal(services, prov.account_id, P) == 0
    assert services.ledger.get_hold(doomed.hold_id).state is HoldState.VOIDED


def test_cancel_mid_run_pays_only_the_work_shown(world):
    services, client, prov, session, key = world
    services.payments.grant(client.account_id, 10 * MICRO, by="test")
    job, _ = services.jobs.submit(client, job_request(
        {"plugin": "echo", "inputs": {"sleep_ms": 3000, "steps": 8}}, services.jobs.catalog))
    assert job.max_price_micro == 1_000_000  # 4 units
    services.dispatcher.match_once()
    services.jobs.accepted(session.provider_id, job.id, 0)
    services.jobs.progress(session.provider_id, job.id, 0, 8, 8)  # claims it all done
    # ... and shows a quarter: a checkpoint at step 2 of 8, which the broker holds
    services.jobs.checkpoints.upload(session.provider_id, job.id, 0, 2, 8, b"state", "")
    services.jobs.cancel(client, job.id)
    # 1 unit × 250,000 (no minimum on a cancel): fee 25,000, provider 225,000.
    assert _bal(services, client.account_id, C) == 10 * MICRO - 250_000
    assert _bal(services, prov.account_id, P) == 225_000
    assert _bal(services, PLATFORM, AccountKind.PLATFORM_FEES) == 25_000
    assert session.cancels and session.cancels[-1][0] == job.id


def test_claimed_progress_alone_pays_nothing_on_a_cancel(world):
    """Issue #20: reporting 100 % and having the client cancel paid 2.7 credits."""
    services, client, prov, session, key = world
    services.payments.grant(client.account_id, 10 * MICRO, by="test")
    job, _ = services.jobs.submit(client, job_request({"plugin": "echo", "inputs": {"sleep_ms": 3000,
                                                                        "steps": 4}}, services.jobs.catalog))
    services.dispatcher.match_once()
    services.jobs.accepted(session.provider_id, job.id, 0)
    for step in range(1, 5):
        services.jobs.progress(session.provider_id, job.id, 0, step, 4)
    services.jobs.cancel(client, job.id)
    assert _bal(services, client.account_id, C) == 10 * MICRO
    assert _bal(services, prov.account_id, P) == 0
    assert services.ledger.get_hold(job.hold_id).state is HoldState.VOIDED


def test_a_cancel_pays_the_tokens_streamed_to_the_client(world):
    services, client, prov, session, key = world
    services.payments.grant(client.account_id, 10 * MICRO, by="test")
    # echo's steps stand in for a text job's max_new_tokens: 4 steps, 4 work units
    job, _ = services.jobs.submit(client, job_request({"plugin": "echo", "inputs": {"sleep_ms": 3000,
                                                                        "steps": 4}}, services.jobs.catalog))
    services.dispatcher.match_once()
    services.jobs.accepted(session.provider_id, job.id, 0)
    services.jobs.progress(session.provider_id, job.id, 0, 0, 0, text="Hel")
    services.jobs.progress(session.provider_id, job.id, 0, 0, 0, text="lo")
    services.jobs.cancel(client, job.id)
    # 2 of 4 steps streamed: 2 units × 250,000
    assert _bal(services, client.account_id, C) == 10 * MICRO - 500_000
    assert _bal(services, prov.account_id, P) == 450_000


def test_idempotent_resubmit_holds_once(world):
    services, client, *_ = world
    services.payments.grant(client.account_id, MICRO, by="test")
    body = {"plugin": "echo", "inputs": {"text": "x"}}
    first, created = services.jobs.submit(client, job_request(body, services.jobs.catalog), idempotency_key="k1")
    again, created_again = services.jobs.submit(client, job_request(body, services.jobs.catalog), idempotency_key="k1")
    assert created and not created_again and again.id == first.id
    assert again.hold_id == first.hold_id
    assert _bal(services, client.account_id, AccountKind.CLIENT_HELD) == 250_000
    # The replay wrote nothing: no audit entry for the hold it found again, no event.
    entries = len(services.audit.search(limit=100))
    events = len(services.jobs.repo.events_after(first.id, 0))
    services.jobs.submit(client, job_request(body, services.jobs.catalog), idempotency_key="k1")
    assert len(services.audit.search(limit=100)) == entries
    assert len(services.jobs.repo.events_after(first.id, 0)) == events
    # Still the first job when the price moved since (the hold taken again would not
    # match the first one): looked up, not refused, and nothing more is held.
    services.pricing.set_price("echo", {"reserve_micro_per_unit": 300_000}, by="test")
    third, created_third = services.jobs.submit(client, job_request(body, services.jobs.catalog), idempotency_key="k1")
    assert third.id == first.id and not created_third
    assert _bal(services, client.account_id, AccountKind.CLIENT_HELD) == 250_000
    with pytest.raises(IdempotencyConflict):  # the same key for another request
        services.jobs.submit(client, job_request({**body, "inputs": {"text": "other"}}, services.jobs.catalog), idempotency_key="k1")
    assert services.audit.verify().ok and services.ledger.verify().ok


def test_job_insert_failure_takes_the_hold_and_its_audit_entry_with_it(world, monkeypatch):
    services, client, *_ = world
    services.payments.grant(client.account_id, MICRO, by="test")
    entries = len(services.audit.search(limit=100))
    real_create = services.jobs.repo.create

    def broken(job, first_event):
        real_create(job, first_event)  # written, then the transaction fails
        raise RuntimeError("database went away")
    monkeypatch.setattr(services.jobs.repo, "create", broken)
    with pytest.raises(RuntimeError):
        services.jobs.submit(client, job_request({"plugin": "echo", "inputs": {}}, services.jobs.catalog))
    # The hold, the job row and the hold's audit entry were one transaction: all gone.
    assert _bal(services, client.account_id, C) == MICRO
    assert _bal(services, client.account_id, AccountKind.CLIENT_HELD) == 0
    assert services.jobs.repo.counts_by_state() == {}
    assert len(services.audit.search(limit=100)) == entries
    monkeypatch.undo()
    job, created = services.jobs.submit(client, job_request({"plugin": "echo", "inputs": {}}, services.jobs.catalog))
    assert created and _bal(services, client.account_id, AccountKind.CLIENT_HELD) == 250_000
    assert [e.action for e in services.audit.search(limit=1)] == ["ledger.hold"]
    assert services.audit.verify().ok and services.ledger.verify().ok


def test_a_post_that_fails_midway_rolls_back_alone_and_the_settlement_stands(world, monkeypatch):
    services, client, prov, session, key = world
    services.payments.grant(client.account_id, MICRO, by="test")
    job, _ = services.jobs.submit(client, job_request({"plugin": "echo", "inputs": {}}, services.jobs.catalog))
    from broker.storage import ledger_sql

    written = ledger_sql._SqlUnitOfWork.add_transaction

    def broken(self, txn):  # after the post's key, hold, transaction and entries were written
        written(self, txn)
        raise RuntimeError("disk full")
    monkeypatch.setattr(ledger_sql._SqlUnitOfWork, "add_transaction", broken)
    settled = _run(services, job, session, key, work_units=1)
    assert settled.state.value == "settled"
    kinds = [e.kind for e in services.jobs.repo.events_after(job.id, 0)]
    assert kinds[-1] == "ledger_error"
    # Nothing of the post stands: the hold is still pending, nobody was paid.
    assert services.ledger.get_hold(job.hold_id).state is HoldState.PENDING
    assert _bal(services, prov.account_id, P) == 0
    assert "ledger.post" not in [e.action for e in services.audit.search(limit=10)]
    monkeypatch.undo()
    # The agent re-sends its receipt (as after a reconnect): the post completes once.
    settled = services.jobs.repo.get(job.id)
    services.jobs.receipt(session.provider_id, key.public_key_hex,
                          canonical_bytes(settled.receipt), settled.receipt_signature)
    assert services.ledger.get_hold(job.hold_id).state is HoldState.POSTED
    assert _bal(services, prov.account_id, P) == 225_000
    assert services.audit.verify().ok and services.ledger.verify().ok


def test_vesting_after_the_window_via_maintenance(world):
    services, client, prov, session, key = world
    services.payments.grant(client.account_id, MICRO, by="test")
    services.pricing.set_price("echo", {"vesting_window_s": 0}, by="test")
    job, _ = services.jobs.submit(client, job_request({"plugin": "echo", "inputs": {}}, services.jobs.catalog))
    _run(services, job, session, key, work_units=1)
    assert services.maintenance.run_once()["vested"] == 1
    assert _bal(services, prov.account_id, AccountKind.PROVIDER_AVAILABLE) == 225_000
    assert _bal(services, prov.account_id, P) == 0


def test_quote_and_prices_over_rest(world):
    services, client, *_ = world
    app = create_app(services).test_client()
    ckey, _ = services.auth.add_key(client.account_id, "client")
    akey, _ = services.auth.create_account_with_key("admin")
    q = app.post("/v1/quotes", json={"plugin": "echo", "inputs": {"sleep_ms": 1000}},
                 headers={"Authorization": f"Bearer {ckey}"})
    assert q.status_code == 200
    assert (q.json["min_micro"], q.json["expected_micro"], q.json["max_micro"]) == (
        100_000, 500_000, 500_000)
    bad = app.post("/v1/quotes", json={"plugin": "echo", "inputs": {"sleep_ms": -1}},
                   headers={"Authorization": f"Bearer {ckey}"})
    assert bad.status_code == 422
    for body, field in (({"plugin": "echo", "zeta": 1, "alpha": 2}, "alpha"), ([1], None)):
        r = app.post("/v1/quotes", json=body, headers={"Authorization": f"Bearer {ckey}"})
        assert r.status_code == 400 and r.json.get("field") == field, r.json
    r = app.post("/v1/admin/grants", json={"account_id": client.account_id, "credits": 1},
                 headers={"Authorization": f"Bearer {ckey}"})
    assert r.status_code == 403 and "admin key; yours is a client key" in r.json["detail"]
    assert app.put("/v1/admin/prices/echo", json={"fee_bps": 500},
                   headers={"Authorization": f"Bearer {ckey}"}).status_code == 403
    put = app.put("/v1/admin/prices/echo", json={"fee_bps": 500},
                  headers={"Authorization": f"Bearer {akey}"})
    assert put.status_code == 200 and put.json["fee_bps"] == 500
    assert put.json["reserve_micro_per_unit"] == 250_000
    for bad_body in ({"fee_bps": 10_000}, {"reserve_micro_per_unit": 1.5}, {"nope": 1}, {}):
        r = app.put("/v1/admin/prices/echo", json=bad_body, headers={"Authorization": f"Bearer {akey}"})
        assert r.status_code == 422 and r.json["code"] == "invalid_price", bad_body
    listed = app.get("/v1/admin/prices", headers={"Authorization": f"Bearer {akey}"}).json["data"]
    assert {p["plugin"] for p in listed} >= {"echo", "sd15", "sdxl", "llama"}
    assert next(p for p in listed if p["plugin"] == "sd15")["default"] is True


def test_dev_funding_mode_grants_and_says_so(world):
    services, client, *_ = world
    app = create_app(services).test_client()
    ckey, _ = services.auth.add_key(client.account_id, "client")
    akey, _ = services.auth.create_account_with_key("admin")
    acct = app.get("/v1/account", headers={"Authorization": f"Bearer {ckey}"})
    assert acct.headers["X-Sparecycles-Funding"] == "dev" and acct.json["funding"] == "dev"
    assert acct.json["available_micro"] == 0
    checkout = app.post("/v1/credits/checkout", json={"credits": 5},
                        headers={"Authorization": f"Bearer {ckey}"})
    assert checkout.status_code == 409 and checkout.json["code"] == "payments_not_configured"
    for body, status in (({"account_id": client.account_id, "credits": "2.5"}, 201),
                         ({"account_id": client.account_id, "credits": -1}, 400),
                         ({"account_id": client.account_id, "credits": 0.5}, 400),
                         ({"account_id": "no-such-account", "credits": 1}, 404)):
        r = app.post("/v1/admin/grants", json=body, headers={"Authorization": f"Bearer {akey}"})
        assert r.status_code == status, (body, r.json)
    assert app.post("/v1/admin/grants", json={"account_id": client.account_id, "credits": 1},
                    headers={"Authorization": f"Bearer {ckey}"}).status_code == 403
    acct = app.get("/v1/account", headers={"Authorization": f"Bearer {ckey}"}).json
    assert acct["available_micro"] == 2_500_000
