"""POST /v1/jobs/bulk through the real Flask app, on SQLite and PostgreSQL: independent
jobs in one request, all of them with their holds or none, each item's error named by its
index, one Idempotency-Key for the whole list, one wake-up of the dispatcher."""
import pytest

from broker.app import create_app
from broker.ledger.model import AccountKind
from broker.services import build_services
from broker.settings import Settings
from tests.integration.conftest import seen_provider


@pytest.fixture
def api(tmp_path, db_url):
    services = build_services(Settings(data_dir=tmp_path, db_url=db_url))
    app = create_app(services)
    key, who = services.auth.create_account_with_key("client")
    services.payments.grant(who.account_id, 1000 * 1_000_000, by="test")
    seen_provider(services, ["echo"])  # echo jobs are admitted and stay queued; sd15 is not
    client = app.test_client()
    client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {key}"
    yield client, services, who.account_id
    services.engine.dispose()


def _echo(text: str, **terms) -> dict:
    return {"plugin": "echo", "inputs": {"text": text}, **terms}


def _state(services, account_id):
    """What a refused request must leave as it was: the jobs and the balances."""
    return services.jobs.repo.counts_by_state(), services.ledger.balances(account_id)


def test_independent_jobs_are_created_in_one_request_in_item_order(api):
    client, services, account = api
    before = services.ledger.balances(account)[AccountKind.CLIENT_AVAILABLE]
    resp = client.post("/v1/jobs/bulk", json={"jobs": [
        _echo("a"), _echo("b", priority="fast"), _echo("c", n=2)]})
    assert resp.status_code == 202, resp.json
    body = resp.json
    assert body["object"] == "list" and len(body["data"]) == 3
    first, second, split = body["data"]
    assert [first["object"], second["object"], split["object"]] == ["job", "job", "batch"]
    assert first["inputs"]["text"] == "a" and second["inputs"]["text"] == "b"
    assert second["priority"] == "fast" and first["priority"] == "standard"
    assert split["n"] == 2 and [j["inputs"]["text"] for j in split["jobs"]] == ["c", "c"]
    assert first["state"] == second["state"] == "queued"
    assert services.jobs.repo.counts_by_state() == {"queued": 4}
    # Each job is one like POST /v1/jobs makes: readable, with its own hold.
    assert client.get(f"/v1/jobs/{second['id']}").json["inputs"]["text"] == "b"
    balances = services.ledger.balances(account)
    held = sum(services.jobs.repo.get(j).max_price_micro
               for j in [first["id"], second["id"]] + [s["id"] for s in split["jobs"]])
    assert balances[AccountKind.CLIENT_HELD] == held > 0
    assert balances[AccountKind.CLIENT_AVAILABLE] == before - held
    # Queue order is item order.
    created = [services.jobs.repo.get(first["id"]).created_at,
               services.jobs.repo.get(second["id"]).created_at,
               services.jobs.repo.get(split["jobs"][0]["id"]).created_at]
    assert created == sorted(created) and len(set(created)) == 3


def test_the_dispatcher_is_woken_once_for_the_whole_request(api, monkeypatch):
    client, services, _ = api
    calls = []
    relay = services.jobs.job_events
    monkeypatch.setattr(relay, "queued",
                        lambda job, siblings=None: calls.append((job, siblings)))
    resp = client.post("/v1/jobs/bulk", json={"jobs": [_echo("a"), _echo("b"),
                                                       _echo("c", n=2)]})
    assert resp.status_code == 202
    assert len(calls) == 1
    job, siblings = calls[0]
    assert [j.id for j in siblings] == [resp.json["data"][0]["id"], resp.json["data"][1]["id"]] \
        + [j["id"] for j in resp.json["data"][2]["jobs"]]
    assert job is siblings[0]


@pytest.mark.parametrize("items,index,status,code,field", [
    ([_echo("a"), {"plugin": "echo", "inputs": {"sleep_ms": -1}}], 1, 422, "invalid_input",
     "jobs[1].inputs.sleep_ms"),
    ([_echo("a"), _echo("b"), {"plugin": "nope"}], 2, 404, "unknown_plugin", "jobs[2].plugin"),
    ([{"plugin": "echo", "colour": "red"}, _echo("b")], 0, 400, "invalid_request",
     "jobs[0].colour"),
    ([_echo("a"), "echo"], 1, 400, "invalid_request", "jobs[1]"),
    ([_echo("a"), _echo("b", n=65)], 1, 400, "invalid_request", "jobs[1].n"),
    # refused when the job is made (no provider serves sd15), after item 0's was written
    ([_echo("a"), {"plugin": "sd15", "inputs": {"prompt": "a cube"}}], 1, 409, "no_provider",
     "jobs[1].plugin"),
])
def test_an_invalid_item_is_named_by_its_index_and_nothing_is_created(api, items, index,
                                                                       status, code, field):
    client, services, account = api
    before = _state(services, account)
    resp = client.post("/v1/jobs/bulk", json={"jobs": items},
                       headers={"Idempotency-Key": "bad"})
    assert resp.status_code == status, resp.json
    assert resp.json["code"] == code and resp.json["field"] == field
    assert resp.json["index"] == index and resp.json["detail"].startswith(f"jobs[{index}]: ")
    assert _state(services, account) == before
    # The key was not spent on a refused request: the corrected list is made with it.
    fixed = client.post("/v1/jobs/bulk", json={"jobs": [_echo("a"), _echo("b")]},
                        headers={"Idempotency-Key": "bad"})
    assert fixed.status_code == 202


@pytest.mark.parametrize("body,fragment", [
    ({"jobs": []}, "send 1 to 256"),
    ({"jobs": [_echo("a")] * 257}, "has 257 job requests; send 1 to 256"),
    ({"jobs": [_echo("a", n=2)] * 129}, "make 258 jobs (each n counted)"),
    ({"jobs": _echo("a")}, 'like {"jobs": ['),
    ([_echo("a")], 'like {"jobs": ['),
    ({"jobs": [_echo("a")], "priority": "fast"}, "unknown field 'priority'"),
])
def test_malformed_or_oversized_lists_are_a_400_and_create_nothing(api, body, fragment):
    client, services, account = api
    before = _state(services, account)
    resp = client.post("/v1/jobs/bulk", json=body)
    assert resp.status_code == 400 and resp.json["code"] == "invalid_request"
    assert fragment in resp.json["detail"], resp.json["detail"]
    assert _state(services, account) == before


def test_the_most_jobs_one_request_makes_are_accepted(api):
    client, services, _ = api
    resp = client.post("/v1/jobs/bulk", json={"jobs": [_echo(str(i)) for i in range(256)]})
    assert resp.status_code == 202
    assert [j["inputs"]["text"] for j in resp.json["data"]] == [str(i) for i in range(256)]
    assert services.jobs.repo.counts_by_state() == {"queued": 256}


def test_a_balance_that_cannot_hold_every_job_is_a_402_and_nothing_is_held(api):
    client, services, _ = api
    one = client.post("/v1/jobs", json=_echo("probe")).json
    price = services.jobs.repo.get(one["id"]).max_price_micro
    key, who = services.auth.create_account_with_key("client")
    services.payments.grant(who.account_id, 2 * price, by="test")  # two jobs' worth, not 3
    other = {"Authorization": f"Bearer {key}"}
    before = _state(services, who.account_id)
    resp = client.post("/v1/jobs/bulk", json={"jobs": [_echo("a"), _echo("b"), _echo("c")]},
                       headers=other)
    assert resp.status_code == 402 and resp.json["code"] == "insufficient_credits"
    assert resp.json["needed_micro"] == 3 * price
    assert resp.json["available_micro"] == 2 * price
    assert resp.json["shortfall_micro"] == price
    assert resp.json["detail"].startswith("these 3 jobs can cost up to")
    assert _state(services, who.account_id) == before
    # Two fit.
    assert client.post("/v1/jobs/bulk", json={"jobs": [_echo("a"), _echo("b")]},
                       headers=other).status_code == 202


def test_a_402_counts_a_job_checked_always_twice_and_never_reports_a_negative_shortfall(api):
    """verify="always" pays two runs: the sum the 402 reports counts that job twice, as its
    hold's check does, so the shortfall is what the client must add."""
    client, services, _ = api
    one = client.post("/v1/jobs", json=_echo("probe")).json
    price = services.jobs.repo.get(one["id"]).max_price_micro
    key, who = services.auth.create_account_with_key("client")
    services.payments.grant(who.account_id, 2 * price, by="test")
    other = {"Authorization": f"Bearer {key}"}
    before = _state(services, who.account_id)
    resp = client.post("/v1/jobs/bulk", json={"jobs": [
        _echo("a"), _echo("b", verify="always")]}, headers=other)
    assert resp.status_code == 402 and resp.json["code"] == "insufficient_credits", resp.json
    assert resp.json["needed_micro"] == 3 * price
    assert resp.json["shortfall_micro"] == price > 0
    assert _state(services, who.account_id) == before
    # With the third job's worth added, the same list is accepted.
    services.payments.grant(who.account_id, price, by="test")
    assert client.post("/v1/jobs/bulk", json={"jobs": [
        _echo("a"), _echo("b", verify="always")]}, headers=other).status_code == 202


def test_a_replayed_list_answers_the_same_jobs_and_charges_nothing_twice(api):
    client, services, account = api
    body = {"jobs": [_echo("a"), _echo("b", n=2), _echo("c")]}
    h = {"Idempotency-Key": "L"}
    made = client.post("/v1/jobs/bulk", json=body, headers=h)
    assert made.status_code == 202
    after = _state(services, account)
    again = client.post("/v1/jobs/bulk", json=body, headers=h)
    assert again.status_code == 200
    ids = [[d["id"]] if d["object"] == "job" else [j["id"] for j in d["jobs"]]
           for d in made.json["data"]]
    assert ids == [[d["id"]] if d["object"] == "job" else [j["id"] for j in d["jobs"]]
                   for d in again.json["data"]]
    assert _state(services, account) == after
    # Without a key, each request is a new one.
    plain = [client.post("/v1/jobs/bulk", json={"jobs": [_echo("a")]}).json["data"][0]["id"]
             for _ in range(2)]
    assert plain[0] != plain[1]


@pytest.mark.parametrize("first_route,first,second_route,second", [
    ("/v1/jobs/bulk", {"jobs": [_echo("a"), _echo("b")]},
     "/v1/jobs/bulk", {"jobs": [_echo("a"), _echo("b"), _echo("c")]}),   # a longer list
    ("/v1/jobs/bulk", {"jobs": [_echo("a"), _echo("b")]},
     "/v1/jobs/bulk", {"jobs": [_echo("b"), _echo("a")]}),               # another order
    ("/v1/jobs/bulk", {"jobs": [_echo("a"), _echo("b")]},
     "/v1/jobs/bulk", {"jobs": [_echo("a")]}),                           # a shorter one
    ("/v1/jobs/bulk", {"jobs": [_echo("a")]}, "/v1/jobs", _echo("a")),    # one job
    ("/v1/jobs", _echo("a"), "/v1/jobs/bulk", {"jobs": [_echo("a")]}),
    ("/v1/jobs", _echo("a"), "/v1/jobs/bulk", {"jobs": [_echo("a"), _echo("b")]}),
    ("/v1/jobs", _echo("a", n=2), "/v1/jobs/bulk", {"jobs": [_echo("a", n=2)]}),
])
def test_one_key_never_makes_two_requests_across_the_submit_routes(api, first_route, first,
                                                                   second_route, second):
    client, services, account = api
    h = {"Idempotency-Key": "K"}
    assert client.post(first_route, json=first, headers=h).status_code == 202
    after = _state(services, account)
    other = client.post(second_route, json=second, headers=h)
    assert other.status_code == 409 and other.json["code"] == "idempotency_conflict"
    assert "used for another request" in other.json["detail"]
    assert _state(services, account) == after
    assert client.post(first_route, json=first, headers=h).status_code == 200


def test_prefer_wait_answers_with_every_job_once_ended_or_the_wait_passed(api):
    client, services, _ = api
    resp = client.post("/v1/jobs/bulk", json={"jobs": [_echo("a"), _echo("b", n=2)]},
                       headers={"Prefer": "wait=0.2"})
    assert resp.status_code == 202 and resp.headers["Preference-Applied"] == "wait=0.2"
    assert [d["object"] for d in resp.json["data"]] == ["job", "batch"]
    assert resp.json["data"][0]["state"] == "queued"
    bad = client.post("/v1/jobs/bulk", json={"jobs": [_echo("a")]},
                      headers={"Prefer": "wait=soon"})
    assert bad.status_code == 400 and bad.json["field"] == "Prefer"
    assert services.jobs.repo.counts_by_state() == {"queued": 3}


def test_a_role_that_cannot_submit_is_refused_before_the_list_is_read(api):
    client, services, _ = api
    key, _ = services.auth.create_account_with_key("provider")
    resp = client.post("/v1/jobs/bulk", json={"jobs": [{"plugin": "nope"}]},
                       headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 403 and resp.json["code"] == "role_cannot_submit"
    assert services.jobs.repo.counts_by_state() == {}
