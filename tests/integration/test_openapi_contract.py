"""/openapi.json against what the app answers: every route is driven (no key, each role's
key, missing, malformed and plausible bodies) through the real Flask app, and every
status it answers must be one the document lists for that route; parameter bounds the
document states must be the ones the server enforces. The test reads only /openapi.json
and the app's URL map, so it holds for any way the document is produced."""
from __future__ import annotations

import re

import pytest
from flask import request_finished

from broker.app import create_app
from broker.services import build_services
from broker.settings import Settings
from tests.integration.conftest import seen_provider

ROLES = ("client", "provider", "publisher", "admin")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    services = build_services(Settings(data_dir=tmp_path_factory.mktemp("contract")))
    app = create_app(services)
    keys, accounts = {}, {}
    for role in ROLES:
        keys[role], who = services.auth.create_account_with_key(role)
        accounts[role] = who.account_id
    services.payments.grant(accounts["client"], 100 * 1_000_000, by="test")
    seen: list[tuple[str, str, int, str]] = []  # (rule, method, status, what was sent)

    def record(sender, response, **extra):
        from flask import request
        if request.url_rule is not None:
            seen.append((request.url_rule.rule, request.method, response.status_code,
                         f"{request.method} {request.full_path}"))
    request_finished.connect(record, app)
    client = app.test_client()
    # A job of the client's to address (GET, DELETE, events, outputs).
    seen_provider(services, ["echo"])  # echo jobs are admitted (and stay queued)
    job = client.post("/v1/jobs", json={"plugin": "echo", "inputs": {"text": "x"}},
                      headers=_auth(keys["client"])).json
    ended = client.post("/v1/jobs", json={"plugin": "echo", "inputs": {"text": "y"}},
                        headers=_auth(keys["client"])).json
    client.delete(f"/v1/jobs/{ended['id']}", headers=_auth(keys["client"]))
    yield {"app": app, "client": client, "keys": keys, "accounts": accounts, "seen": seen,
           "job": job, "ended": ended, "doc": client.get("/openapi.json").json}
    request_finished.disconnect(record, app)
    services.close()


def _auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _doc_path(rule: str) -> str:
    return re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule)


def _fill(rule: str, job_id: str) -> list[str]:
    """Concrete URLs for a rule: its path parameters as something that exists and as
    something that does not."""
    known = {"job_id": job_id, "batch_id": job_id, "index": "0", "name": "echo",
             "plugin": "echo", "version": "1.0.0", "sha256": "0" * 64, "path": "plugin.toml",
             "provider_id": "p", "key_id": "0000000000000000"}
    unknown = {**known, "job_id": "nope", "batch_id": "nope", "index": "9", "name": "nope",
               "plugin": "nope", "version": "9.9.9", "path": "nope.txt"}
    return sorted({re.sub(r"<(?:\w+:)?(\w+)>", lambda m: table[m.group(1)], rule)
                   for table in (known, unknown)})


SAMPLE_BODIES = {  # plausible bodies per route (plus {}, [], garbage for every route)
    "/v1/jobs": [{"plugin": "echo", "inputs": {"text": "hi"}},
                 {"plugin": "echo", "inputs": {"text": "hi"}, "n": 2},
                 {"plugin": "sd15", "inputs": {"prompt": "a cube"}},
                 {"plugin": "echo", "inputs": {"sleep_ms": -1}},
                 {"plugin": "echo", "max_price_micro": 1, "deadline_s": 1}],
    "/v1/jobs/bulk": [{"jobs": [{"plugin": "echo", "inputs": {"text": "a"}},
                                {"plugin": "echo", "inputs": {"text": "b"}, "n": 2}]},
                      {"jobs": [{"plugin": "echo", "inputs": {"text": "a"}},
                                {"plugin": "echo", "inputs": {"sleep_ms": -1}}]},
                      {"jobs": [{"plugin": "sd15", "inputs": {"prompt": "a cube"}}]},
                      {"jobs": [{"plugin": "nope"}]},
                      {"jobs": []},
                      {"jobs": [{"plugin": "echo", "inputs": {"text": "a"}}] * 257}],
    "/v1/quotes": [{"plugin": "echo", "inputs": {}}, {"plugin": "sd15", "inputs": {}}],
    "/v1/account/stake": [{"amount_micro": 1}, {"amount_micro": 0}],
    "/v1/account/unstake": [{"amount_micro": 1}],
    "/v1/credits/checkout": [{"credits": 1}],
    "/v1/payouts": [{"credits": 1}, {"amount_micro": 5}],
    "/v1/admin/grants": [{"account_id": "nobody", "credits": 1}],
    "/v1/admin/prices/<plugin>": [{"reserve_micro_per_unit": 5}, {"fee_bps": -1}],
    "/v1/admin/market": [{"reputation_floor": 0.5}, {"reputation_floor": 2}],
    "/v1/publishers": [{"public_key": "00", "proof": "00"}],
    "/v1/plugins": [{"document": {}, "signature": "00"}],
    "/v1/adapters": [{"document": {"kind": "adapter"}, "signature": "00"}],
    "/v1/chat/completions": [{"model": "llama", "messages": [{"role": "user", "content": "hi"}]},
                             {"model": "llama", "messages": [], "stream": True},
                             {"model": "echo", "messages": [{"role": "tool"}]},
                             {"model": "llama", "messages": [{"role": "user", "content": 1}],
                              "tools": [{}], "n": 9}],
    "/v1/completions": [{"model": "llama", "prompt": "hi", "stream": True},
                        {"model": "llama", "prompt": [1, 2], "best_of": 3}],
    "/v1/images/generations": [{"model": "sd15", "prompt": "a cube", "size": "64x64"},
                               {"model": "sd15", "prompt": "a cube", "size": "huge",
                                "response_format": "gif"}],
}


def _drive(world) -> list[tuple[str, str, int, str]]:
    client, keys = world["client"], world["keys"]
    world["seen"].clear()
    for rule in world["app"].url_map.iter_rules():
        if not rule.rule.startswith("/v1"):
            continue
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            bodies: list = [None]
            if method in ("POST", "PUT"):
                bodies += [b"", b"{}", b"[]", b"{not json", *SAMPLE_BODIES.get(rule.rule, [])]
            for url in _fill(rule.rule, world["job"]["id"]):
                for key in (None, "sc_client_0000000000000000_bad", *keys.values()):
                    for body in bodies:
                        kwargs = ({"json": body} if isinstance(body, (dict, list)) else
                                  {"data": body, "content_type": "application/json"}
                                  if body is not None else {})
                        client.open(url, method=method, headers=_auth(key), **kwargs)
    return world["seen"]


def test_every_status_the_app_answers_is_in_the_openapi_document(world):
    seen = _drive(world)
    paths = world["doc"]["paths"]
    missing, errors = set(), set()
    for rule, method, status, sent in seen:
        if status >= 500:
            errors.add(f"{sent} -> {status}")
            continue
        op = paths.get(_doc_path(rule), {}).get(method.lower())
        assert op is not None, f"{method} {rule} is not in /openapi.json"
        if str(status) not in op["responses"]:
            missing.add(f"{method} {_doc_path(rule)}: {status} (e.g. {sent})")
    assert not errors, "server errors:\n" + "\n".join(sorted(errors))
    assert not missing, "statuses the document does not list:\n" + "\n".join(sorted(missing))


def test_parameter_bounds_in_the_document_are_the_ones_the_server_enforces(world):
    """For every documented integer or number parameter with bounds: a value just past a
    bound is refused with a 400 naming it, and the bound itself is not refused (on a job
    that has ended, so that a long poll or an event stream answers at once)."""
    client, keys, job_id = world["client"], world["keys"], world["ended"]["id"]
    checked = 0
    for path, operations in world["doc"]["paths"].items():
        if not path.startswith("/v1"):
            continue
        url = re.sub(r"\{(\w+)\}", lambda m: {"index": "0"}.get(m.group(1), job_id), path)
        for method, op in operations.items():
            if method != "get":
                continue
            for param in op.get("parameters", []):
                schema = param.get("schema", {})
                if schema.get("type") not in ("integer", "number") or param["in"] == "path":
                    continue
                step = 1 if schema["type"] == "integer" else 0.5
                for bound, outside in (("minimum", -step), ("maximum", step)):
                    if bound not in schema:
                        continue
                    for value, refused in ((schema[bound], False),
                                           (schema[bound] + outside, True)):
                        where = ({"query_string": {param["name"]: str(value)}}
                                 if param["in"] == "query"
                                 else {"headers": {param["name"]: str(value)}})
                        headers = {**_auth(keys["admin" if "admin" in path else "client"]),
                                   **where.pop("headers", {})}
                        resp = client.get(url, headers=headers, **where)
                        named = resp.status_code == 400 and resp.json.get("field") == param["name"]
                        assert named == refused, (
                            f"GET {path} with {param['name']}={value}: the document "
                            f"{'refuses' if refused else 'allows'} it, the server answered "
                            f"{resp.status_code} {resp.get_data(as_text=True)[:200]}")
                        checked += 1
                        resp.close()
    assert checked >= 12
    print("HUB", world["app"].extensions["sparecycles"].jobs.hub.__dict__.keys())  # limit, wait, after and Last-Event-ID on their routes


def test_a_405_says_which_methods_the_route_allows(world):
    resp = world["client"].put("/v1/jobs", headers=_auth(world["keys"]["client"]))
    assert resp.status_code == 405 and resp.json["code"] == "method_not_allowed"
    assert set(resp.headers["Allow"].split(", ")) >= {"GET", "POST"}


def test_an_empty_plugin_name_is_refused_as_the_document_says(world):
    schema = world["doc"]["components"]["schemas"]["JobRequest"]["properties"]["plugin"]
    assert schema.get("minLength") == 1
    resp = world["client"].post("/v1/jobs", json={"plugin": ""},
                                headers=_auth(world["keys"]["client"]))
    assert resp.status_code == 400 and resp.json["field"] == "plugin"
