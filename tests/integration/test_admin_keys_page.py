"""The console's API keys page: every key with its scopes and state; revoke and rotate
through CSRF-checked forms (audited); the console's cookies are Secure over TLS and every
page carries a content security policy."""
import re

import pytest

from broker.app import create_app
from broker.services import build_services
from broker.settings import Settings
from tests.integration.test_admin_console_forms import _csrf, _sign_in


@pytest.fixture
def console(tmp_path):
    services = build_services(Settings(data_dir=tmp_path, maintenance_interval_s=0))
    client = create_app(services).test_client()
    yield client, services
    services.engine.dispose()


def test_keys_page_lists_revokes_and_rotates(console):
    client, services = console
    csrf = _sign_in(client, services)
    key, who = services.auth.create_account_with_key("client", scopes="jobs:read")
    page = client.get("/admin/keys").get_data(as_text=True)
    row = re.search(rf'<tr data-key="{who.key_id}">(.*?)</tr>', page, re.S).group(1)
    assert "jobs:read" in row and "active" in row

    r = client.post(f"/admin/keys/{who.key_id}/action",
                    data={"action": "rotate", "grace_s": "0", "csrf_token": csrf})
    assert r.status_code == 200
    new_key = re.search(r'<pre class="mono" id="new-key">(sc_client_[^<]+)</pre>',
                        r.get_data(as_text=True)).group(1)
    assert services.auth.authenticate(new_key).scopes == {"jobs:read"}
    new_id = new_key.split("_")[2]
    r = client.post(f"/admin/keys/{new_id}/action",
                    data={"action": "revoke", "csrf_token": csrf}, follow_redirects=True)
    assert "revoked" in r.get_data(as_text=True)
    assert services.auth.repo.get_key(new_id).state(services.auth.clock()) == "revoked"
    # A form without the session's CSRF token changes nothing.
    other, other_who = services.auth.create_account_with_key("client")
    r = client.post(f"/admin/keys/{other_who.key_id}/action", data={"action": "revoke"})
    assert r.status_code == 403
    assert services.auth.repo.get_key(other_who.key_id).revoked_at is None
    assert {e.action for e in services.audit.repo.search(subject=f"key:{who.key_id}")} \
        == {"key.rotate"}


def test_console_cookies_are_secure_over_tls_and_pages_carry_a_csp(console):
    client, services = console
    key, _ = services.auth.create_account_with_key("admin")
    form = client.get("/admin/login", base_url="https://localhost")
    assert "default-src 'self'" in form.headers["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in form.headers["Content-Security-Policy"]
    r = client.post("/admin/login", base_url="https://localhost",
                    data={"api_key": key, "csrf_token": _csrf(form.get_data(as_text=True))})
    assert r.status_code == 302
    session = [c for c in r.headers.getlist("Set-Cookie") if c.startswith("sc_admin=")]
    assert session and "Secure" in session[0] and "HttpOnly" in session[0]
    # Plain http on loopback (no TLS): the cookie cannot be Secure or the browser drops it.
    form = client.get("/admin/login")
    r = client.post("/admin/login",
                    data={"api_key": key, "csrf_token": _csrf(form.get_data(as_text=True))})
    session = [c for c in r.headers.getlist("Set-Cookie") if c.startswith("sc_admin=")]
    assert session and "Secure" not in session[0]


def test_an_admin_reading_a_prompt_is_audited(console):
    from tests.integration.conftest import seen_provider

    client, services = console
    _sign_in(client, services)
    seen_provider(services, ["echo"])
    key, _ = services.auth.create_account_with_key("client")
    services.payments.grant(services.auth.authenticate(key).account_id, 10**7, by="test")
    job = client.post("/v1/jobs", json={"plugin": "echo", "inputs": {"text": "private"}},
                      headers={"Authorization": f"Bearer {key}"}).json
    page = client.get(f"/admin/jobs/{job['id']}").get_data(as_text=True)
    assert "private" in page
    viewed = services.audit.repo.search(subject=f"job:{job['id']}", action="job.viewed")
    assert len(viewed) == 1 and viewed[0].actor.startswith("admin:")
