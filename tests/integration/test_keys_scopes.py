"""Keys with a lifecycle and scopes: a narrowed key is refused a route with a 403 naming
the missing scope; keys exchange for short-lived JWTs holding their scopes or fewer; a key
revoked on one replica stops working on another within seconds (tokens and live agent
streams too); an expired key is refused saying so; rotation keeps the old key working for
its grace period only."""
from __future__ import annotations

import base64
import time

import grpc
import pytest

from broker.app import create_app
from broker.auth.service import KEY_CACHE_S
from broker.errors import Forbidden
from broker.services import build_services
from broker.settings import Settings
from sdk.protocol.signing import KeyPair
from tests.integration.test_gateway_and_sdk import RawAgent, _handshake

SECRET = "x" * 48  # replicas share the token secret
AT_REST = base64.b64encode(b"k" * 32).decode()  # and the at-rest key (a replica with another is refused)


def _auth(key):
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def replicas(tmp_path):
    """Two replicas (apps over their own services) sharing one database."""
    db = f"sqlite:///{tmp_path / 'shared.db'}"
    out = []
    for name in ("a", "b"):
        svc = build_services(Settings(data_dir=tmp_path / name, db_url=db, verification=False,
                                      admin_session_secret=SECRET, at_rest_key=AT_REST))
        out.append((create_app(svc).test_client(), svc))
    yield out
    for _, svc in out:
        svc.close()


def _until(fn, timeout_s: float = KEY_CACHE_S + 3):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fn():
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_a_narrowed_key_gets_403_naming_the_missing_scope(replicas):
    (a, svc), _ = replicas
    key, who = svc.auth.create_account_with_key("client", scopes="jobs:read,account:read")
    assert who.scopes == {"jobs:read", "account:read"}
    resp = a.post("/v1/jobs", json={"plugin": "echo", "inputs": {"text": "x"}},
                  headers=_auth(key))
    assert resp.status_code == 403
    assert resp.json["code"] == "missing_scope" and resp.json["missing_scope"] == "jobs:write"
    assert "'jobs:write'" in resp.json["detail"]
    assert a.get("/v1/jobs", headers=_auth(key)).status_code == 200
    assert a.get("/v1/account", headers=_auth(key)).status_code == 200
    # A key cannot hold what its role may not, nor an unknown scope.
    for bad, words in (("publish", "cannot hold"), ("jobs:everything", "unknown scope")):
        with pytest.raises(Exception, match=words):
            svc.auth.create_account_with_key("client", scopes=bad)
    # Nor hand out more than it holds to a key it creates.
    resp = a.post("/v1/keys", json={"scopes": ["jobs:write"]}, headers=_auth(key))
    assert resp.status_code == 403 and resp.json["missing_scope"] in ("jobs:write", "keys:write")


def test_keys_exchange_for_short_lived_tokens_with_fewer_scopes(replicas):
    (a, svc), (b, _) = replicas
    key, _ = svc.auth.create_account_with_key("client")
    resp = a.post("/v1/auth/token", json={"scopes": ["jobs:read"], "ttl_s": 60},
                  headers=_auth(key))
    assert resp.status_code == 201, resp.json
    token = resp.json["access_token"]
    assert resp.json["scopes"] == ["jobs:read"] and resp.json["expires_in"] == 60
    assert token.startswith("eyJ")
    # The token works on the other replica too, within its scopes only.
    assert b.get("/v1/jobs", headers=_auth(token)).status_code == 200
    refused = b.get("/v1/account", headers=_auth(token))
    assert refused.status_code == 403 and refused.json["missing_scope"] == "account:read"
    # A token cannot mint tokens; a key cannot mint more than it holds; tokens expire.
    assert a.post("/v1/auth/token", headers=_auth(token)).status_code in (403,)
    narrow, _ = svc.auth.create_account_with_key("client", scopes="jobs:read")
    over = a.post("/v1/auth/token", json={"scopes": ["jobs:write"]}, headers=_auth(narrow))
    assert over.status_code == 403 and over.json["missing_scope"] == "jobs:write"
    short = a.post("/v1/auth/token", json={"ttl_s": 1}, headers=_auth(key)).json["access_token"]
    time.sleep(1.1)
    gone = a.get("/v1/jobs", headers=_auth(short))
    assert gone.status_code == 401 and gone.json["code"] == "token_expired"
    tampered = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    assert a.get("/v1/jobs", headers=_auth(tampered)).status_code == 401


def test_a_key_revoked_on_one_replica_stops_on_the_other_within_seconds(replicas):
    (a, svc_a), (b, svc_b) = replicas
    key, who = svc_a.auth.create_account_with_key("client")
    token = a.post("/v1/auth/token", headers=_auth(key)).json["access_token"]
    assert b.get("/v1/account", headers=_auth(key)).status_code == 200
    assert b.get("/v1/account", headers=_auth(token)).status_code == 200  # cached on b now
    revoked_at = time.monotonic()
    resp = a.delete(f"/v1/keys/{who.key_id}", headers=_auth(key))
    assert resp.status_code == 200 and resp.json["state"] == "revoked"
    stopped = _until(lambda: b.get("/v1/account", headers=_auth(key)).status_code == 401)
    assert stopped - revoked_at <= KEY_CACHE_S + 0.5
    after = b.get("/v1/account", headers=_auth(token))
    assert after.status_code == 401 and after.json["code"] == "key_revoked"
    # Another account's key cannot be revoked through the API.
    other, other_who = svc_a.auth.create_account_with_key("client")
    mine, _ = svc_a.auth.create_account_with_key("client")
    assert a.delete(f"/v1/keys/{other_who.key_id}", headers=_auth(mine)).status_code == 404
    assert a.get("/v1/account", headers=_auth(other)).status_code == 200


def test_expiry_and_rotation(replicas):
    (a, svc), (b, _) = replicas
    key, _ = svc.auth.create_account_with_key("client", expires_at=time.time() + 1.0)
    assert a.get("/v1/account", headers=_auth(key)).status_code == 200
    time.sleep(1.1)
    resp = a.get("/v1/account", headers=_auth(key))
    assert resp.status_code == 401 and resp.json["code"] == "key_expired"
    assert "expired at" in resp.json["detail"]

    old, who = svc.auth.create_account_with_key("client", scopes="jobs:read,account:read")
    resp = a.post(f"/v1/keys/{who.key_id}/rotate", json={"grace_s": 1.5},
                  headers=_auth(old))
    assert resp.status_code == 403  # rotating needs keys:write, which this key lacks
    new, old_record = svc.auth.rotate(who.key_id, grace_s=1.5)
    assert b.get("/v1/account", headers=_auth(new)).status_code == 200
    assert b.get("/v1/account", headers=_auth(old)).status_code == 200  # in its grace
    listed = {k["id"]: k for k in a.get("/v1/keys", headers=_auth(
        svc.auth.add_key(who.account_id, "client")[0])).json["data"]}
    new_id = new.split("_")[2]
    assert listed[new_id]["scopes"] == ["jobs:read", "account:read"]
    assert listed[old_record.id]["revoked_at"] is not None
    _until(lambda: b.get("/v1/account", headers=_auth(old)).status_code == 401, 5)
    assert b.get("/v1/account", headers=_auth(new)).status_code == 200


def test_grpc_needs_agent_connect_and_a_revoked_key_drops_the_stream(live_broker):
    svc = live_broker.services
    narrowed, _ = svc.auth.create_account_with_key("provider", scopes="account:read")
    raw = RawAgent(live_broker.grpc, narrowed)
    raw.send(hello=pb_hello())
    with pytest.raises(grpc.RpcError) as refused:
        raw.recv()
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'agent:connect'" in refused.value.details()
    raw.close()

    # A token exchanged for a provider key connects an agent; one without the scope is
    # refused naming it.
    key, who = svc.auth.create_account_with_key("provider")
    token = svc.auth.issue_token(svc.auth.authenticate(key))["access_token"]
    raw = RawAgent(live_broker.grpc, token)
    assert _handshake(raw, KeyPair.generate()).WhichOneof("body") == "welcome"
    raw.close()
    narrow = svc.auth.issue_token(svc.auth.authenticate(key), ["account:read"])["access_token"]
    raw = RawAgent(live_broker.grpc, narrow)
    raw.send(hello=pb_hello())
    with pytest.raises(grpc.RpcError) as refused:
        raw.recv()
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'agent:connect'" in refused.value.details()
    raw.close()

    raw = RawAgent(live_broker.grpc, key)
    assert _handshake(raw, KeyPair.generate()).WhichOneof("body") == "welcome"
    revoked_at = time.monotonic()
    svc.auth.revoke(who.key_id)
    with pytest.raises(grpc.RpcError) as dropped:
        while True:
            raw.recv()
    assert dropped.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "revoked" in dropped.value.details()
    assert time.monotonic() - revoked_at <= 2 * KEY_CACHE_S + 1
    raw.close()


def pb_hello():
    from sdk.protocol import agent_pb2 as pb

    return pb.Hello(public_key=KeyPair.generate().public_key_hex, name="narrow")


def test_keys_command_lists_rotates_and_revokes(tmp_path, capsys):
    from types import SimpleNamespace

    from sdk.cli import main

    data = ["--data-dir", str(tmp_path / "b")]

    def run(*args, ok=True):  # the `sparecycles broker ...` command, in this process
        code = main(["broker", *args, *data])
        out = capsys.readouterr()
        assert (code == 0) == ok, out.err
        return SimpleNamespace(stdout=out.out, stderr=out.err)

    key = run("create-key", "--role", "client", "--scopes", "jobs:read",
              "--expires", "30d").stdout.strip().splitlines()[-1]
    key_id = key.split("_")[2]
    listed = run("keys", "list").stdout
    assert key_id in listed and "jobs:read" in listed and "active" in listed
    bad = run("create-key", "--role", "client", "--scopes", "publish", ok=False)
    assert "cannot hold" in bad.stderr
    rotated = run("keys", "rotate", key_id, "--grace", "0").stdout.strip().splitlines()[-1]
    assert rotated.startswith("sc_client_") and rotated != key
    assert "revoked" in run("keys", "list").stdout
    assert "already revoked" in run("keys", "revoke", key_id).stdout
    assert "revoked" in run("keys", "revoke", rotated.split("_")[2]).stdout
    assert "no key" in run("keys", "revoke", "nope", ok=False).stderr


def test_may_hand_out_caps_scopes_and_expiry_and_refuses_tokens(replicas):
    (a, svc), _ = replicas
    ends = time.time() + 3600
    key, who = svc.auth.create_account_with_key("client", scopes="jobs:read,keys:write",
                                                expires_at=ends)
    # Create: the new key expires no later than the caller's own, whatever it asks.
    made = a.post("/v1/keys", json={"scopes": ["jobs:read"], "expires_in_s": 86400},
                  headers=_auth(key))
    assert made.status_code == 201, made.json
    assert made.json["expires_at"] <= ends + 1e-6 and made.json["scopes"] == ["jobs:read"]
    assert a.post("/v1/keys", json={}, headers=_auth(key)).json["expires_at"] <= ends + 1e-6
    # No scope in common: refused, naming what was asked and what the caller holds.
    none = a.post("/v1/keys", json={"scopes": ["account:read"]}, headers=_auth(key))
    assert none.status_code == 403 and "account:read" in none.json["detail"]
    assert "jobs:read" in none.json["detail"] and "in common" in none.json["detail"]
    # A token cannot create or rotate keys, nor mint tokens: its principal says it is one.
    token = a.post("/v1/auth/token", headers=_auth(key)).json["access_token"]
    by_token = svc.auth.authenticate(token)
    assert by_token.via_token and not svc.auth.authenticate(key).via_token
    for resp in (a.post("/v1/keys", json={}, headers=_auth(token)),
                 a.post(f"/v1/keys/{who.key_id}/rotate", headers=_auth(token))):
        assert resp.status_code == 403 and "full API key" in resp.json["detail"]
        assert resp.json["code"] == "token_not_allowed"
    again = a.post("/v1/auth/token", headers=_auth(token))
    assert again.status_code == 403 and again.json["code"] == "token_not_allowed"
    for hand_out in (lambda: svc.auth.may_hand_out(by_token, None, None),
                     lambda: svc.auth.rotate(who.key_id, caller=by_token),
                     lambda: svc.auth.issue_token(by_token)):
        with pytest.raises(Forbidden, match="full API key|not a token"):
            hand_out()
    # Rotate: through the same check (a narrowed key cannot rotate a fuller one) ...
    full, full_who = svc.auth.add_key(who.account_id, "client")
    over = a.post(f"/v1/keys/{full_who.key_id}/rotate", headers=_auth(key))
    assert over.status_code == 403 and over.json["code"] == "missing_scope"
    rotated = a.post(f"/v1/keys/{who.key_id}/rotate", headers=_auth(key))
    assert rotated.status_code == 201 and rotated.json["expires_at"] <= ends + 1e-6
    # ... and another account's key only by an admin.
    other, other_who = svc.auth.create_account_with_key("client")
    assert a.post(f"/v1/keys/{other_who.key_id}/rotate", headers=_auth(full)).status_code == 404
    admin, _ = svc.auth.create_account_with_key("admin")
    by_admin = a.post(f"/v1/keys/{other_who.key_id}/rotate", headers=_auth(admin))
    assert by_admin.status_code == 201, by_admin.json
    assert by_admin.json["account_id"] == other_who.account_id
    assert by_admin.json["role"] == "client"


def test_every_v1_route_names_its_scope_or_is_public(tmp_path):
    """A narrowed key is refused any route missing from ROUTE_SCOPES; every /v1 route of
    the app is in the table (or open without a key), so none is refused by omission."""
    from broker.api import openai_compat
    from broker.app import PUBLIC
    from broker.auth.scopes import ROUTE_SCOPES

    svc = build_services(Settings(data_dir=tmp_path / "b", verification=False))
    try:
        app = create_app(svc)
        missing = sorted(f"{rule.endpoint} ({rule.rule})" for rule in app.url_map.iter_rules()
                         if rule.rule.startswith("/v1") and rule.rule not in PUBLIC
                         and rule.endpoint not in openai_compat.PUBLIC_ENDPOINTS
                         and rule.endpoint not in ROUTE_SCOPES)
        assert not missing, f"routes with no scope in broker/auth/scopes.py: {missing}"
    finally:
        svc.close()
