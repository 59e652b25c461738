"""The REST API through the real Flask app: auth, RFC 7807 errors, idempotency, schema."""
import pytest

from broker.app import create_app
from broker.services import build_services
from broker.settings import Settings


@pytest.fixture
def api(tmp_path):
    services = build_services(Settings(data_dir=tmp_path))
    app = create_app(services)
    key, who = services.auth.create_account_with_key("client")
    services.payments.grant(who.account_id, 1000 * 1_000_000, by="test")
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
