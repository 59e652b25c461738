"""The REST API through the real Flask app: auth, RFC 7807 errors, idempotency, schema."""
import pytest

from broker.app import create_app
from broker.services import build_services
from broker.settings import Settings
from tests.integration.conftest import seen_provider


@pytest.fixture
def api(tmp_path):
    services = build_services(Settings(data_dir=tmp_path))
    app = create_app(services)
    key, who = services.auth.create_account_with_key("client")
    services.payments.grant(who.account_id, 1000 * 1_000_000, by="test")
    # An echo agent was connected a moment ago (none is now): echo jobs are admitted and
    # stay queued; nobody serves sd15.
    seen_provider(services, ["echo"])
    client = app.test_client()
    client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {key}"
    yield client, services
    services.engine.dispose()


def _no_jobs(services):
    assert services.jobs.repo.counts_by_state() == {}


def test_health_and_openapi_need_no_key(api):
    client, _ = api
    anon = client.application.test_client()
    assert anon.get("/livez").json == {"status": "ok"}
    assert anon.get("/readyz").status_code == 200
    doc = anon.get("/openapi.json").json
    assert doc["openapi"].startswith("3.") and "/v1/jobs" in doc["paths"]


@pytest.mark.parametrize("header,fragment", [
    (None, "no API key"),
    ("Bearer nonsense", "malformed API key"),
    ("Bearer sc_client_0123456789abcdef_wrongsecret", "not recognised"),
])
def test_missing_or_bad_key_is_401_problem(api, header, fragment):
    client, services = api
    anon = client.application.test_client()
    headers = {"Authorization": header} if header else {}
    resp = anon.post("/v1/jobs", json={"plugin": "echo"}, headers=headers)
    assert resp.status_code == 401 and resp.mimetype == "application/problem+json"
    assert resp.json["code"] == "unauthenticated" and fragment in resp.json["detail"]
    _no_jobs(services)


@pytest.mark.parametrize("kwargs,status,code,field", [
    ({"data": "{not json", "content_type": "application/json"}, 400, "malformed_json", None),
    ({"data": ""}, 400, "invalid_request", None),
    ({"json": {"plugin": "nope"}}, 404, "unknown_plugin", "plugin"),
    ({"json": {"plugin": "echo", "inputs": {"sleep_ms": 99999999}}}, 422, "invalid_input",
     "inputs.sleep_ms"),
    ({"json": {"plugin": "echo", "inputs": {"text": ["x"]}}}, 422, "invalid_input", "inputs.text"),
    ({"json": {"plugin": "echo", "inputs": "text"}}, 422, "invalid_input", "inputs"),
    ({"json": {"plugin": 5}}, 400, "invalid_request", "plugin"),
])
def test_bad_input_is_a_problem_naming_the_field_and_creates_nothing(api, kwargs, status, code,
                                                                     field):
    client, services = api
    resp = client.post("/v1/jobs", **kwargs)
    assert resp.status_code == status, resp.json
    body = resp.json
    assert body["code"] == code and body["status"] == status and body["detail"]
    assert body.get("field") == field
    _no_jobs(services)


def test_out_of_range_message_says_what_is_allowed(api):
    client, _ = api
    resp = client.post("/v1/jobs", json={"plugin": "echo", "inputs": {"sleep_ms": -5}})
    assert "between 0 and 60000" in resp.json["detail"]


def test_submit_get_cancel_and_idempotency(api):
    client, services = api
    h = {"Idempotency-Key": "abc"}
    first = client.post("/v1/jobs", json={"plugin": "echo", "inputs": {"text": "hi"}}, headers=h)
    assert first.status_code == 202 and first.json["state"] == "queued"
    again = client.post("/v1/jobs", json={"plugin": "echo", "inputs": {"text": "hi"}}, headers=h)
    assert again.status_code == 200 and again.json["id"] == first.json["id"]
    other = client.post("/v1/jobs", json={"plugin": "echo", "inputs": {"text": "no"}}, headers=h)
    assert other.status_code == 409 and other.json["code"] == "idempotency_conflict"
    job_id = first.json["id"]
    assert client.get(f"/v1/jobs/{job_id}").json["inputs"]["text"] == "hi"
    assert client.get(f"/v1/jobs/{job_id}?wait=0.1").json["state"] == "queued"
    assert client.get(f"/v1/jobs/{job_id}?wait=zz").json["field"] == "wait"
    assert client.delete(f"/v1/jobs/{job_id}").json["state"] == "cancelled"
    assert client.get(f"/v1/jobs/{job_id}/outputs/0").json["code"] == "output_not_found"
    assert client.get("/v1/jobs/unknown").status_code == 404
    events = client.get(f"/v1/jobs/{job_id}/events")
    assert events.mimetype == "text/event-stream"
    text = events.get_data(as_text=True)
    assert "event: queued" in text and "event: cancelled" in text
    assert services.jobs.repo.counts_by_state() == {"cancelled": 1}


@pytest.mark.parametrize("prefer", ["wait=soon", "wait=-1", "wait=61", "respond-async, wait=x"])
def test_a_bad_prefer_wait_is_refused_before_any_job_exists(api, prefer):
    client, services = api
    resp = client.post("/v1/jobs", json={"plugin": "echo", "inputs": {"text": "hi"}},
                       headers={"Prefer": prefer})
    assert resp.status_code == 400 and resp.json["field"] == "Prefer"
    assert "seconds" in resp.json["detail"]
    _no_jobs(services)


def test_prefer_wait_answers_when_the_job_ends_or_the_wait_passes(api):
    import threading
    import time

    client, services = api
    t = time.monotonic()
    resp = client.post("/v1/jobs", json={"plugin": "echo", "inputs": {"text": "a"}},
                       headers={"Prefer": "respond-async, wait=0.3, handling=lenient"})
    assert resp.status_code == 202 and resp.json["state"] == "queued"
    assert resp.headers["Preference-Applied"] == "wait=0.3"
    assert time.monotonic() - t >= 0.3
    # No agent is connected: the job only ends when it is cancelled during the wait.
    seen: list = []

    def cancel_soon():  # polls for longer than the POST below waits
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            time.sleep(0.05)
            queued = services.jobs.repo.queued(10)
            if len(queued) == 2:
                services.jobs.cancel(services.auth.authenticate(
                    client.environ_base["HTTP_AUTHORIZATION"].split()[1]), queued[-1].id)
                seen.append(queued[-1].id)
                return

    canceller = threading.Thread(target=cancel_soon)
    canceller.start()
    t = time.monotonic()
    resp = client.post("/v1/jobs", json={"plugin": "echo", "inputs": {"text": "b"}},
                       headers={"Prefer": "wait=30"})
    canceller.join()
    assert seen, "second job never queued"
    assert resp.json["id"] == seen[0] and resp.json["state"] == "cancelled"
    assert time.monotonic() - t < 10  # woken by the end, not by the 30 s wait


def test_a_split_request_waits_for_every_sibling(api):
    import threading
    import time

    client, services = api
    t = time.monotonic()
    resp = client.post("/v1/jobs", json={"plugin": "echo", "inputs": {"text": "a"}, "n": 2},
                       headers={"Prefer": "wait=0.3"})
    assert resp.status_code == 202 and resp.json["object"] == "batch"
    assert resp.headers["Preference-Applied"] == "wait=0.3"
    assert time.monotonic() - t >= 0.3 and not resp.json["done"]
    batch_id, siblings = resp.json["id"], [j["id"] for j in resp.json["jobs"]]
    bad = client.get(f"/v1/batches/{batch_id}?wait=soon")
    assert bad.status_code == 400 and bad.json["field"] == "wait"
    # No agent is connected: the siblings end only when they are cancelled, one after
    # the other, while the GET below waits; it answers after the second, not the first.
    who = services.auth.authenticate(client.environ_base["HTTP_AUTHORIZATION"].split()[1])

    def cancel_both():
        for job_id in siblings:
            time.sleep(0.2)
            services.jobs.cancel(who, job_id)

    canceller = threading.Thread(target=cancel_both)
    canceller.start()
    t = time.monotonic()
    got = client.get(f"/v1/batches/{batch_id}?wait=30")
    canceller.join()
    assert got.json["done"] and [j["state"] for j in got.json["jobs"]] == ["cancelled"] * 2
    assert 0.4 <= time.monotonic() - t < 10  # woken by the last end, not by the 30 s wait


def test_plugins_list_their_input_schema(api):
    client, _ = api
    names = {p["name"]: p for p in client.get("/v1/plugins").json["data"]}
    assert {"echo", "sd15"} <= set(names)
    schema = names["sd15"]["input_schema"]
    assert schema["properties"]["width"]["multipleOf"] == 8 and "prompt" in schema["required"]
    assert client.get("/v1/plugins/nope").json["code"] == "unknown_plugin"


def test_unknown_route_is_a_problem_too(api):
    client, _ = api
    resp = client.get("/v1/nothing-here")
    assert resp.status_code == 404 and resp.json["code"] == "not_found"


def test_every_v1_route_is_in_the_openapi_document(api):
    client, _ = api
    paths = client.get("/openapi.json").json["paths"]
    for rule in client.application.url_map.iter_rules():
        if not rule.rule.startswith("/v1"):
            continue
        path = (rule.rule.replace("<int:", "<").replace("<path:", "<")
                .replace("<", "{").replace(">", "}"))
        assert path in paths, f"{rule.rule} is missing from /openapi.json"
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            assert method.lower() in paths[path], f"{method} {rule.rule} is not documented"


# ---- one Idempotency-Key, one request ----------------------------------------------------
_ECHO = {"plugin": "echo", "inputs": {"text": "x"}}


@pytest.mark.parametrize("first,second", [
    ({**_ECHO, "n": 2}, _ECHO),                       # a batch, then one job
    (_ECHO, {**_ECHO, "n": 2}),                       # one job, then a batch
    ({**_ECHO, "n": 2}, {**_ECHO, "n": 3}),           # another split
    ({**_ECHO, "n": 2, "max_price_micro": 5000}, {**_ECHO, "max_price_micro": 2500}),
    (_ECHO, {**_ECHO, "priority": "fast"}),
])
def test_one_idempotency_key_never_makes_two_charged_requests(api, first, second):
    client, services = api
    who = services.auth.authenticate(client.environ_base["HTTP_AUTHORIZATION"].split()[1])
    h = {"Idempotency-Key": "K"}
    made = client.post("/v1/jobs", json=first, headers=h)
    assert made.status_code == 202
    held = services.ledger.balances(who.account_id)
    counts = services.jobs.repo.counts_by_state()
    other = client.post("/v1/jobs", json=second, headers=h)
    assert other.status_code == 409 and other.json["code"] == "idempotency_conflict"
    assert "used for another request" in other.json["detail"]
    # nothing of the second request exists: no job, no hold
    assert services.jobs.repo.counts_by_state() == counts
    assert services.ledger.balances(who.account_id) == held
    again = client.post("/v1/jobs", json=first, headers=h)  # the first, unchanged: its answer
    assert again.status_code == 200 and again.json["id"] == made.json["id"]
    assert again.json["object"] == made.json["object"]
    assert services.ledger.balances(who.account_id) == held


# ---- bodies, numbers and failures that must never be a 500 --------------------------------
@pytest.mark.parametrize("raw,code,field", [
    ('{"plugin": "echo", "inputs": {"text": "\\ud800"}}', "invalid_text", "inputs.text"),
    ('{"plugin": "echo", "inputs": {"text": "a\\udfffb"}}', "invalid_text", "inputs.text"),
    ('{"plugin": "echo", "inputs": {"\\ud800": "x"}}', "invalid_text", None),
    ('{"plugin": "echo", "inputs": {"text": "a\\u0000b"}}', "invalid_text", "inputs.text"),
    ('{"plugin": "echo", "inputs": {"text": "' + "\\\\ud800" + '"}}', None, None),  # text
    ('{"plugin": "echo", "x": ' + "[" * 1000 + "]" * 1000 + "}", "nested_too_deep", None),
    ('{"plugin": "echo", "x": ' + "[" * 100000 + "]" * 100000 + "}", "nested_too_deep", None),
    ('{"plugin": "echo", "x": ' + '{"a": ' * 40 + "1" + "}" * 40 + "}", "nested_too_deep", None),
    ('{"plugin": "echo", "max_price_micro": 99999999999999999999999}', "malformed_json",
     "max_price_micro"),
    ('{"plugin": "echo", "inputs": {"sleep_ms": -9223372036854775809}}', "malformed_json",
     "inputs.sleep_ms"),
    ('{"plugin": "echo", "max_price_micro": ' + "9" * 5000 + "}", "malformed_json", None),
    ('{"plugin": "echo", "deadline_s": 1e999}', "malformed_json", "deadline_s"),
    ('{"plugin": "echo", "deadline_s": NaN}', "malformed_json", None),
    ('{"plugin": "echo", "deadline_s": -Infinity}', "malformed_json", None),
])
def test_bodies_no_storage_could_hold_are_refused_with_400(api, raw, code, field):
    client, services = api
    resp = client.post("/v1/jobs", data=raw.encode(), content_type="application/json")
    if code is None:  # an escaped backslash: just text, accepted
        assert resp.status_code in (202, 409), resp.json
        return
    assert resp.status_code == 400 and resp.mimetype == "application/problem+json", resp.data
    assert resp.json["code"] == code and resp.json.get("field") == field
    _no_jobs(services)


def test_a_body_that_is_not_utf8_is_a_400(api):
    client, services = api
    resp = client.post("/v1/jobs", data=b'{"plugin": "echo\xff"}', content_type="application/json")
    assert resp.status_code == 400 and "UTF-8" in resp.json["detail"]
    _no_jobs(services)


@pytest.mark.parametrize("query,headers", [
    ({"after": str(2**63)}, {}), ({"after": str(2**64)}, {}), ({"after": "-1"}, {}),
    ({"after": "9" * 5000}, {}), ({}, {"Last-Event-ID": str(2**63)}),
    ({}, {"Last-Event-ID": "1e3"}),
])
def test_event_ids_out_of_storage_range_are_a_400_not_a_500(api, query, headers):
    client, _ = api
    job = client.post("/v1/jobs", json=_ECHO).json
    resp = client.get(f"/v1/jobs/{job['id']}/events", query_string=query, headers=headers)
    assert resp.status_code == 400 and resp.mimetype == "application/problem+json"
    assert resp.json["field"] in ("after", "Last-Event-ID")
    assert str(2**63 - 1) in resp.json["detail"].replace(",", "")


def test_an_unexpected_failure_is_a_problem_with_the_request_id_and_writes_nothing(api):
    """A storage failure the broker did not expect (here: a table gone) answers RFC 7807
    JSON quoting the request's id (never a plain-text page), on a plain request and
    inside an event stream that has begun; the failed submit left no job and no hold."""
    from sqlalchemy import text

    client, services = api
    who = services.auth.authenticate(client.environ_base["HTTP_AUTHORIZATION"].split()[1])
    job = client.post("/v1/jobs", json=_ECHO).json
    balances = services.ledger.balances(who.account_id)
    with services.engine.begin() as c:
        c.execute(text("DROP TABLE job_events"))
    resp = client.post("/v1/jobs", json=_ECHO, headers={"X-Request-Id": "req-42"})
    assert resp.status_code == 500 and resp.mimetype == "application/problem+json"
    assert resp.json["code"] == "internal" and resp.json["request_id"] == "req-42"
    assert "req-42" in resp.json["detail"] and resp.headers["X-Request-Id"] == "req-42"
    assert services.ledger.balances(who.account_id) == balances  # no hold of its own
    assert [j.id for j in services.jobs.repo.list_for_account(who.account_id)] == [job["id"]]
    stream = client.get(f"/v1/jobs/{job['id']}/events", headers={"X-Request-Id": "req-43"})
    assert stream.status_code == 200  # the stream began before the failure
    text_ = stream.get_data(as_text=True)
    assert "event: error" in text_ and '"code": "internal"' in text_ and "req-43" in text_


def test_every_answer_carries_a_request_id(api):
    client, _ = api
    assert len(client.get("/v1/account").headers["X-Request-Id"]) >= 16
    assert client.get("/v1/account", headers={"X-Request-Id": "mine"}).headers[
        "X-Request-Id"] == "mine"
    assert client.get("/v1/nothing").json["request_id"]


# ---- roles ------------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["provider", "publisher"])
def test_a_role_that_cannot_submit_gets_403_naming_the_role_and_nothing_is_opened(api, role):
    from broker.ledger.model import AccountKind

    client, services = api
    key, who = services.auth.create_account_with_key(role)
    resp = client.post("/v1/jobs", json=_ECHO, headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 403 and resp.json["code"] == "role_cannot_submit"
    assert f"a {role} key" in resp.json["detail"] and "client key" in resp.json["detail"]
    _no_jobs(services)
    assert AccountKind.CLIENT_AVAILABLE not in services.ledger.balances(who.account_id)


def test_an_admin_may_submit_and_is_told_when_its_balance_is_short(api):
    client, services = api
    key, _ = services.auth.create_account_with_key("admin")
    resp = client.post("/v1/jobs", json=_ECHO, headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 402 and resp.json["code"] == "insufficient_credits"


@pytest.mark.parametrize("role,claimed", [("provider", "client"), ("client", "admin"),
                                          ("publisher", "provider")])
def test_a_key_whose_prefix_is_not_its_role_is_refused(api, role, claimed):
    client, services = api
    key, _ = services.auth.create_account_with_key(role)
    forged = key.replace(f"sc_{role}_", f"sc_{claimed}_", 1)
    resp = client.get("/v1/account", headers={"Authorization": f"Bearer {forged}"})
    assert resp.status_code == 401 and resp.json["code"] == "unauthenticated"
    assert f"issued as a {role} key" in resp.json["detail"]
    assert client.get("/v1/account", headers={"Authorization": f"Bearer {key}"}).json[
        "role"] == role


def test_a_new_provider_is_told_in_its_own_terms_why_it_cannot_stake_yet(api):
    """README: ``provider.stake(5_000_000)``. A new provider has no available (vested)
    credits: the refusal says so in GET /v1/account's words, never a ledger account."""
    client, services = api
    key, who = services.auth.create_account_with_key("provider")
    h = {"Authorization": f"Bearer {key}"}
    resp = client.post("/v1/account/stake", json={"amount_micro": 5_000_000}, headers=h)
    assert resp.status_code == 402 and resp.json["code"] == "insufficient_credits"
    detail = resp.json["detail"]
    assert "provider_available" not in detail and who.account_id not in detail
    assert "5 credits" in detail and "0 credits available" in detail and "vest" in detail
    assert resp.json["field"] == "amount_micro" and resp.json["available_micro"] == 0


def _earn(services, client, provider_account: str, micro: int, job: str, **post) -> None:
    """The provider earns ``micro`` from a job of the api client (a settled hold)."""
    from broker.ledger.model import Splits

    payer = services.auth.authenticate(client.environ_base["HTTP_AUTHORIZATION"].split()[1])
    hold = services.ledger.hold(payer.account_id, micro, job, idempotency_key=f"job:{job}:hold")
    services.ledger.post(hold.id, Splits(provider=provider_account, provider_micro=micro),
                         idempotency_key=f"job:{job}:post", **post)


def test_a_provider_with_vesting_earnings_is_told_when_they_vest(api):
    client, services = api
    key, who = services.auth.create_account_with_key("provider")
    _earn(services, client, who.account_id, 2_500_000, "job-1")
    resp = client.post("/v1/account/stake", json={"amount_micro": 1_000_000},
                       headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 402
    assert "2.5 credits vesting" in resp.json["detail"] and " UTC" in resp.json["detail"]


def test_one_key_on_stake_and_unstake_is_refused_the_second_time(api):
    client, services = api
    key, who = services.auth.create_account_with_key("provider")
    services.ledger.open_provider(who.account_id)
    h = {"Authorization": f"Bearer {key}", "Idempotency-Key": "S"}
    first = client.post("/v1/account/stake", json={"amount_micro": 1}, headers=h)
    assert first.status_code == 402  # nothing to stake: refused, and the key stays free
    from broker.ledger.model import AccountId, AccountKind

    _earn(services, client, who.account_id, 2_000_000, "job-2", vesting_window_s=0)
    services.ledger.vest(who.account_id)
    assert services.ledger.balance(AccountId(AccountKind.PROVIDER_AVAILABLE, who.account_id))
    assert client.post("/v1/account/stake", json={"amount_micro": 1_000_000},
                       headers=h).status_code == 200
    again = client.post("/v1/account/stake", json={"amount_micro": 1_000_000}, headers=h)
    assert again.status_code == 200 and again.json["stake_micro"] == 1_000_000  # a replay
    other = client.post("/v1/account/unstake", json={"amount_micro": 1_000_000}, headers=h)
    assert other.status_code == 409 and other.json["code"] == "idempotency_conflict"
    assert client.get("/v1/account", headers={"Authorization": f"Bearer {key}"}).json[
        "stake_micro"] == 1_000_000


# ---- a job nobody could run ---------------------------------------------------------------
def test_a_job_no_provider_serves_is_refused_at_once_and_holds_nothing(api):
    client, services = api
    who = services.auth.authenticate(client.environ_base["HTTP_AUTHORIZATION"].split()[1])
    before = services.ledger.balances(who.account_id)
    resp = client.post("/v1/jobs", json={"plugin": "sd15", "inputs": {"prompt": "a cube"}},
                       headers={"Prefer": "wait=30"})
    assert resp.status_code == 409 and resp.json["code"] == "no_provider"
    assert resp.json["plugin"] == "sd15" and resp.json["version"] == "1.1.0"
    assert "no provider serves sd15@1.1.0" in resp.json["detail"]
    assert "nothing was queued or held" in resp.json["detail"]
    assert services.jobs.repo.counts_by_state() == {}
    assert services.ledger.balances(who.account_id) == before
    seen_provider(services, ["sd15"])  # an sd15 agent connected (and dropped) a moment ago
    later = client.post("/v1/jobs", json={"plugin": "sd15", "inputs": {"prompt": "a cube"}})
    assert later.status_code == 202 and later.json["state"] == "queued"


def test_queued_jobs_whose_plugin_has_had_no_provider_for_the_window_fail_refunded(tmp_path):
    """SPARECYCLES_UNSERVED_EXPIRY_S: once no provider has served a plugin for that long,
    its queued jobs fail ``no_provider`` and their holds are voided."""
    import time

    services = build_services(Settings(data_dir=tmp_path, unserved_expiry_s=1.0,
                                       maintenance_interval_s=0))
    try:
        client = create_app(services).test_client()
        key, who = services.auth.create_account_with_key("client")
        services.payments.grant(who.account_id, 10 * 1_000_000, by="test")
        seen_provider(services, ["echo"])
        funded = services.ledger.balances(who.account_id)
        h = {"Authorization": f"Bearer {key}"}
        job = client.post("/v1/jobs", json=_ECHO, headers=h).json
        batch = client.post("/v1/jobs", json={**_ECHO, "n": 2}, headers=h).json
        assert services.maintenance.run_once() is not None
        assert client.get(f"/v1/jobs/{job['id']}", headers=h).json["state"] == "queued"
        time.sleep(1.2)  # the provider was last seen longer ago than the window
        services.maintenance.run_once()
        for job_id in [job["id"]] + [j["id"] for j in batch["jobs"]]:
            got = client.get(f"/v1/jobs/{job_id}", headers=h).json
            assert got["state"] == "failed" and got["error"]["code"] == "no_provider"
            assert "released in full" in got["error"]["message"]
        assert services.ledger.balances(who.account_id) == funded  # every hold voided
        events = client.get(f"/v1/jobs/{job['id']}/events", headers=h).get_data(as_text=True)
        assert "event: failed" in events and "no_provider" in events
    finally:
        services.close()


def test_unserved_expiry_zero_turns_the_check_off(tmp_path):
    services = build_services(Settings(data_dir=tmp_path, unserved_expiry_s=0))
    try:
        client = create_app(services).test_client()
        key, who = services.auth.create_account_with_key("client")
        services.payments.grant(who.account_id, 10 * 1_000_000, by="test")
        resp = client.post("/v1/jobs", json={"plugin": "sd15", "inputs": {"prompt": "x"}},
                           headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 202
    finally:
        services.close()


# ---- what the manifest and the registry can tell, refused at submit -----------------------
@pytest.mark.parametrize("inputs,field,fragment", [
    ({"prompt": " ".join(["castle"] * 80)}, "inputs.prompt", "at least 80 tokens"),
    ({"prompt": "a cube", "negative_prompt": "blurry " * 90}, "inputs.negative_prompt",
     "at most 75"),
    ({"prompt": "a cube", "init_image": "iVBORw0KGgo=", "steps": 3, "strength": 0.2},
     "inputs.strength", "3 × 0.2"),
    ({"prompt": "a cube", "adapters": "ink:1.0.0"}, "inputs.adapters", "give a number"),
    ({"prompt": "a cube", "adapters": "a,b,c,d,e"}, "inputs.adapters", "at most 4"),
    ({"prompt": "a cube", "adapters": "ink:9"}, "inputs.adapters", "between -4 and 4"),
    ({"prompt": "a cube", "adapters": "ink, ink"}, "inputs.adapters", "given twice"),
])
def test_inputs_a_provider_would_refuse_are_refused_at_submit(api, inputs, field, fragment):
    client, services = api
    seen_provider(services, ["sd15"])
    resp = client.post("/v1/jobs", json={"plugin": "sd15", "inputs": inputs})
    assert resp.status_code == 422 and resp.json["code"] == "invalid_input", resp.json
    assert resp.json["field"] == field and fragment in resp.json["detail"]
    _no_jobs(services)
    quote = client.post("/v1/quotes", json={"plugin": "sd15", "inputs": inputs})
    assert quote.status_code == 422 and quote.json["field"] == field


def test_what_the_rules_allow_is_accepted(api):
    client, services = api
    seen_provider(services, ["sd15", "llama"])
    for plugin, inputs in (("sd15", {"prompt": " ".join(["castle"] * 75)}),
                           ("sd15", {"prompt": "a", "init_image": "iVBORw0KGgo=", "steps": 5,
                                     "strength": 0.2, "adapters": "ink:0.8,film"}),
                           ("llama", {"messages": '[{"role": "user", "content": "hi"}]'})):
        resp = client.post("/v1/jobs", json={"plugin": plugin, "inputs": inputs})
        assert resp.status_code == 202, resp.json


def test_a_llama_job_with_both_or_neither_prompt_and_messages_is_refused(api):
    client, services = api
    for inputs in ({}, {"prompt": "hi", "messages": '[{"role": "user", "content": "hi"}]'}):
        resp = client.post("/v1/jobs", json={"plugin": "llama", "inputs": inputs})
        assert resp.status_code == 422 and resp.json["field"] == "inputs.prompt"
        assert "exactly one of prompt" in resp.json["detail"]


def test_the_served_schema_carries_the_rules_and_the_sdk_checks_them(api):
    from sdk.protocol.schema import InputError, InputSchema

    client, _ = api
    schema = client.get("/v1/plugins/sd15").json["input_schema"]
    assert {r["field"] for r in schema["x-rules"]} >= {"prompt", "strength", "adapters"}
    with pytest.raises(InputError, match="at most 75"):
        InputSchema.from_json_schema(schema).validate({"prompt": "castle " * 80})


def test_an_adapter_published_for_another_plugin_is_refused_at_submit(api, tmp_path):
    from tests.marketplace_helpers import adapter_folder, publish, register

    client, services = api
    seen_provider(services, ["sd15", "sdxl"])
    _, publisher = services.auth.create_account_with_key("publisher")
    keys = register(services.registry, publisher)
    publish(services.registry, publisher, keys, adapter_folder(tmp_path, name="ink", base="sdxl"))
    resp = client.post("/v1/jobs", json={"plugin": "sd15",
                                         "inputs": {"prompt": "a cube", "adapters": "ink:0.8"}})
    assert resp.status_code == 422 and resp.json["field"] == "inputs.adapters"
    assert "'ink' is an adapter for sdxl, not for sd15" in resp.json["detail"]
    _no_jobs(services)
    ok = client.post("/v1/jobs", json={"plugin": "sdxl",
                                       "inputs": {"prompt": "a cube", "adapters": "ink:0.8"}})
    assert ok.status_code == 202
    # a name the registry does not know may be a provider's own adapter: left to it
    own = client.post("/v1/jobs", json={"plugin": "sd15",
                                        "inputs": {"prompt": "a cube", "adapters": "mine"}})
    assert own.status_code == 202
