"""The admin console's forms and sign-in page through the real Flask app (issue #30): a
price form for a plugin that does not exist is refused naming the plugins there are, and
the sign-in page shows only the console's own notices, never words a link chose."""
import html
import re

import pytest

from broker.app import create_app
from broker.services import build_services
from broker.settings import Settings


@pytest.fixture
def console(tmp_path):
    services = build_services(Settings(data_dir=tmp_path, maintenance_interval_s=0))
    client = create_app(services).test_client()
    yield client, services
    services.engine.dispose()


def _csrf(page: str) -> str:
    return re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)


def _sign_in(client, services) -> str:
    """Sign in with a new admin key; returns the session's CSRF token (from a page)."""
    key, _ = services.auth.create_account_with_key("admin")
    form = client.get("/admin/login").get_data(as_text=True)
    r = client.post("/admin/login", data={"api_key": key, "csrf_token": _csrf(form)})
    assert r.status_code == 302, r.get_data(as_text=True)
    return _csrf(client.get("/admin/pricing").get_data(as_text=True))


def test_a_price_for_a_plugin_that_does_not_exist_is_refused_naming_the_plugins(console):
    client, services = console
    csrf = _sign_in(client, services)
    r = client.post("/admin/pricing/stable-difusion", data={
        "csrf_token": csrf, "reserve_micro_per_unit": "0.5"}, follow_redirects=True)
    page = html.unescape(r.get_data(as_text=True))
    assert ("stable-difusion: nothing saved — there is no plugin 'stable-difusion' to price; "
            "this broker's plugins are echo, llama, sd15, sdxl") in page
    assert [p.plugin for p in services.pricing.repo.all()] == []  # no row was written
    assert 'data-plugin="stable-difusion"' not in page
    assert services.audit.search(action="pricing.set", limit=5) == []
    # a plugin that exists is priced as before
    r = client.post("/admin/pricing/echo", data={
        "csrf_token": csrf, "reserve_micro_per_unit": "0.5"}, follow_redirects=True)
    assert "echo: saved reserve / work unit" in r.get_data(as_text=True)
    assert services.pricing.price("echo", fresh=True).reserve_micro_per_unit == 500_000


def test_the_sign_in_page_shows_only_its_own_notices(console):
    client, _ = console
    bait = "Your key leaked: call +1 555 0100 or visit evil.example to restore access"
    page = client.get("/admin/login", query_string={"why": bait}).get_data(as_text=True)
    assert "555 0100" not in page and "evil.example" not in page
    assert 'role="alert"' not in page  # no notice at all for an unknown code
    page = client.get("/admin/login?why=expired").get_data(as_text=True)
    assert "Your session expired; sign in again." in page


def test_the_console_sends_a_code_not_a_message_to_the_sign_in_page(console):
    client, services = console
    r = client.get("/admin/ledger")
    assert r.status_code == 302
    location = r.headers["Location"]
    assert "why=required" in location and "sign+in" not in location.lower()
    page = client.get(location).get_data(as_text=True)
    assert "That page needs an admin session: sign in first." in page
    csrf = _sign_in(client, services)
    r = client.post("/admin/logout", data={"csrf_token": csrf})
    assert "why=signed_out" in r.headers["Location"]
    assert "You signed out." in client.get(r.headers["Location"]).get_data(as_text=True)
