"""Rate limits per account and per route group: past its budget an account gets 429 with
Retry-After (other keys and other groups are not touched); counters in Redis are shared by
every replica naming it."""
from __future__ import annotations

import base64
import socket
import time

import pytest

from broker.app import create_app
from broker.services import build_services
from broker.settings import Settings


AT_REST = base64.b64encode(b"r" * 32).decode()  # replicas share it, or the second is refused


def _auth(key):
    return {"Authorization": f"Bearer {key}"}


def _app(tmp_path, name="a", **settings):
    svc = build_services(Settings(data_dir=tmp_path / name, verification=False,
                                  db_url=f"sqlite:///{tmp_path / 'shared.db'}",
                                  admin_session_secret="s" * 40,
                                  at_rest_key=AT_REST, **settings))
    return create_app(svc).test_client(), svc


def test_past_its_budget_a_key_gets_429_with_retry_after(tmp_path):
    # a 5 s window: on a loaded machine three requests can take longer than one second,
    # and the fourth would then fall in a fresh window
    client, svc = _app(tmp_path, rate_limits="jobs:read=3/5second,default=50/second")
    try:
        key, _ = svc.auth.create_account_with_key("client")
        other, _ = svc.auth.create_account_with_key("client")
        assert [client.get("/v1/jobs", headers=_auth(key)).status_code
                for _ in range(3)] == [200, 200, 200]
        refused = client.get("/v1/jobs", headers=_auth(key))
        assert refused.status_code == 429
        assert refused.json["code"] == "rate_limited" and refused.json["group"] == "jobs:read"
        assert 1 <= int(refused.headers["Retry-After"]) <= 6
        assert refused.json["retry_after_s"] == int(refused.headers["Retry-After"])
        # Another key, and another route group of the same key, keep their own budgets.
        assert client.get("/v1/jobs", headers=_auth(other)).status_code == 200
        assert client.get("/v1/account", headers=_auth(key)).status_code == 200
        # A token exchanged for the key shares the key's budget.
        token = client.post("/v1/auth/token", headers=_auth(key)).json["access_token"]
        assert client.get("/v1/jobs", headers=_auth(token)).status_code == 429
        time.sleep(int(refused.headers["Retry-After"]) + 0.1)
        assert client.get("/v1/jobs", headers=_auth(key)).status_code == 200
    finally:
        svc.close()


def test_limits_can_be_turned_off_and_bad_specs_are_named(tmp_path):
    client, svc = _app(tmp_path, rate_limits="off")
    try:
        key, _ = svc.auth.create_account_with_key("client")
        assert all(client.get("/v1/jobs", headers=_auth(key)).status_code == 200
                   for _ in range(30))
    finally:
        svc.close()
    with pytest.raises(ValueError, match="GROUP one of"):
        Settings(data_dir=tmp_path / "x", rate_limits="jobs=3/second")
    with pytest.raises(ValueError, match="not a rate"):
        Settings(data_dir=tmp_path / "x", rate_limits="jobs:read=lots")


def _redis_up() -> bool:
    try:
        socket.create_connection(("127.0.0.1", 6379), timeout=0.5).close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _redis_up(), reason="no Redis on 127.0.0.1:6379")
def test_replicas_share_the_budget_through_redis(tmp_path):
    shared = {"rate_limits": "jobs:read=4/10seconds",
              "rate_limit_storage": "redis://127.0.0.1:6379/0"}
    a, svc_a = _app(tmp_path, "a", **shared)
    b, svc_b = _app(tmp_path, "b", **shared)
    try:
        key, _ = svc_a.auth.create_account_with_key("client")  # a new account: fresh counters
        codes = [c.get("/v1/jobs", headers=_auth(key)).status_code for c in (a, b, a, b, a, b)]
        assert codes == [200, 200, 200, 200, 429, 429]
    finally:
        svc_a.close()
        svc_b.close()


def test_the_budget_is_the_accounts_so_minting_keys_does_not_multiply_it(tmp_path):
    client, svc = _app(tmp_path, rate_limits="jobs:read=3/10second,default=50/second")
    try:
        key, who = svc.auth.create_account_with_key("client")
        more = [svc.auth.add_key(who.account_id, "client")[0] for _ in range(3)]
        codes = [client.get("/v1/jobs", headers=_auth(k)).status_code
                 for k in (key, *more)]
        assert codes == [200, 200, 200, 429]
        refused = client.get("/v1/jobs", headers=_auth(more[0]))
        assert refused.status_code == 429 and "account" in refused.json["detail"]
    finally:
        svc.close()
