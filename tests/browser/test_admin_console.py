"""The admin console in a real browser (Debian's headless Chromium driven by Playwright)
against a live broker with two real in-process agents on loopback.

The tests share one broker and one browser (module fixtures), but each sets up what it
asserts on (a signed-in session, the jobs it looks at, the price it changes) and puts
back what others could see (a paused provider, a tampered audit row), so they pass in any
order and alone. Screenshots of every page go to artifacts/screenshots/.
"""
from __future__ import annotations

import pytest

from plugins import builtin_plugin_dir
from tests.browser.conftest import FIXTURE_PLUGINS, chromium_page, shot
from tests.integration.conftest import LiveBroker, agent_starter

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from broker.settings import BUILTIN_PLUGINS
    from sdk.client import Client

    broker = LiveBroker(tmp_path_factory.mktemp("console"),
                        plugin_dirs=[BUILTIN_PLUGINS, FIXTURE_PLUGINS])
    start, stop_all = agent_starter(broker)
    served = {"echo": builtin_plugin_dir("echo"), "swatch": FIXTURE_PLUGINS / "swatch"}
    agents = [start("alpha", slots=2, plugins=served), start("bravo", slots=2, plugins=served)]
    with chromium_page() as (browser, context, page):
        class Env:
            pass
        e = Env()
        e.broker, e.page, e.context, e.browser = broker, page, context, browser
        e.url = broker.url
        e.admin_key = broker.key("admin")
        e.client = Client(broker.url, broker.key("client", credits=1000))
        e.alpha, e.bravo = agents
        yield e
    stop_all()
    broker.stop()


@pytest.fixture
def console(env):
    """The page, signed in with the admin key (again, if a test signed out)."""
    page = env.page
    page.goto(env.url + "/admin/")
    if "/admin/login" in page.url:
        page.fill("input[name=api_key]", env.admin_key)
        page.click("button[type=submit]")
        assert page.url.endswith("/admin/"), page.url
    return page


@pytest.fixture(scope="module")
def swatches(env):
    """Two settled swatch jobs (images), made once for the tests that look at them."""
    jobs = [env.client.jobs.create("swatch", color=c) for c in ("e5484d", "30a46c")]
    for j in jobs:
        j.wait(timeout=30)
    return [j.id for j in jobs]


def test_login_refuses_bad_keys_and_accepts_an_admin_key(env):
    page = env.page
    env.context.clear_cookies()  # signed out, whatever ran before
    page.goto(env.url + "/admin/pricing")
    assert "/admin/login" in page.url
    page.fill("input[name=api_key]", env.broker.key("client"))
    page.click("button[type=submit]")
    assert page.locator(".flash.error").inner_text().startswith("this is a client key")
    shot(page, "01-login")
    page.fill("input[name=api_key]", env.admin_key)
    page.click("button[type=submit]")
    assert page.url.endswith("/admin/pricing")  # back where the admin was going
    cookie = next(c for c in env.context.cookies() if c["name"] == "sc_admin")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    # a form without the CSRF token is refused and changes nothing
    before = env.broker.services.pricing.price("echo", fresh=True)
    r = env.context.request.post(env.url + "/admin/pricing/echo",
                                 form={"reserve_micro_per_unit": "9"}, max_redirects=0)
    assert r.status == 403 and "Form expired" in r.text()
    assert env.broker.services.pricing.price("echo", fresh=True) == before


def test_reserve_price_change_is_used_by_the_next_quote(env, console):
    page = console
    before = env.client.quote("echo", text="hi")
    old = before["price"]["reserve_micro_per_unit"]
    new = 4200 if old != 4200 else 4300  # a change, whatever the price was
    fee = env.broker.services.pricing.price("echo", fresh=True).fee_bps
    page.goto(env.url + "/admin/pricing")
    card = page.locator("form[data-plugin=echo]")
    # the result cache's price per hit is one of the admin's prices (issue #24)
    cache_price = env.broker.services.pricing.price("echo", fresh=True).cache_price_micro
    assert float(card.locator("input[name=cache_price_micro]").input_value()) * 1e6 == \
        pytest.approx(cache_price)
    card.locator("input[name=reserve_micro_per_unit]").fill(f"{new / 1e6:.4f}")
    card.locator("input[name=min_stake_micro]").fill("25")
    card.locator("button[type=submit]").click()
    assert "echo: saved" in page.locator(".flash.ok").inner_text()
    after = env.client.quote("echo", text="hi")
    assert after["price"]["reserve_micro_per_unit"] == new
    assert after["max_micro"] == max(new, after["price"]["min_charge_micro"])
    # the change is audited with before and after
    assert f"{old} → {new}" in page.locator("section.card").last.inner_text()
    shot(page, "02-pricing")
    # a bad value is refused with a clear message, nothing saved
    card = page.locator("form[data-plugin=echo]")
    card.locator("input[name=fee_bps]").fill("lots")
    card.locator("button[type=submit]").click()
    assert "nothing saved" in page.locator(".flash.error").inner_text()
    assert env.broker.services.pricing.price("echo", fresh=True).fee_bps == fee


def test_paused_provider_receives_no_new_jobs(env, console):
    page = console
    page.goto(env.url + "/admin/providers")
    assert page.locator("tr[data-provider]").count() == 2
    shot(page, "03-providers")
    page.click(f"tr[data-provider='{env.alpha.provider_id}'] a")
    page.fill("textarea[name=reason]", "suspicious outputs (test)")
    page.click("button[value=pause]")
    try:
        assert page.locator("#provider-status").inner_text() == "paused"
        shot(page, "04-provider-paused")
        jobs = [env.client.jobs.create("echo", text=f"j{i}") for i in range(4)]
        for j in jobs:
            j.wait(timeout=30)
        providers = {env.client.jobs.get(j.id).data.get("provider_id") or
                     env.broker.services.jobs.repo.get(j.id).provider_id for j in jobs}
        assert providers == {env.bravo.provider_id}
        # resume without a reason is refused; with one it works
        page.click("button[value=resume]")  # HTML 'required' blocks an empty reason
        assert page.locator("#provider-status").inner_text() == "paused"
        page.fill("textarea[name=reason]", "checked, fine")
        page.click("button[value=resume]")
        assert page.locator("#provider-status").inner_text() == "active"
    finally:  # the other tests get both providers, whatever happened here
        if env.broker.services.providers.get(env.alpha.provider_id).status != "active":
            env.broker.services.admin.provider_action(env.alpha.provider_id, "resume",
                                                      "test cleanup", by="test")


def test_job_page_shows_image_and_receipt(env, console, swatches):
    page = console
    page.goto(env.url + "/admin/jobs?plugin=swatch")
    listed = page.locator("table.jobs tbody tr a.mono").all_inner_texts()
    assert all(job_id[:8] in listed for job_id in swatches)
    shot(page, "05-jobs")
    a = env.client.jobs.get(swatches[0])
    page.goto(env.url + f"/admin/jobs/{a.id}")
    img = page.locator("img.thumb").first
    img.wait_for()
    assert page.evaluate("(el) => el.complete && el.naturalWidth", img.element_handle()) == 64
    receipt = page.locator("#receipt").inner_text()
    assert a.id in receipt and "envelope_sha256" in receipt
    assert "ledger.post" in page.content()  # the settlement is in the job's audit trail
    shot(page, "06-job")


def test_admin_resolves_a_dispute(env, console, swatches):
    page = console
    page.goto(env.url + "/admin/disputes")
    assert "No open disputes" in page.content()
    repo = env.broker.services.jobs.repo
    first, second = (repo.get(i) for i in swatches)
    sides = [{"provider_id": j.provider_id, "job_id": j.id, "output_index": 0,
              "sha256": repo.outputs(j.id)[0].sha256, "media_type": "image/png",
              "verdict": v} for j, v in ((first, "majority"), (second, "minority"))]
    if sides[0]["provider_id"] == sides[1]["provider_id"]:
        sides[1]["provider_id"] = env.alpha.provider_id if sides[0]["provider_id"] != env.alpha.provider_id else env.bravo.provider_id
    d = env.broker.services.disputes.open(first.id, "swatch", sides,
                                          {"ssim": 0.41, "psnr_db": 12.3, "phash_distance": 22},
                                          "2-of-3: the check run and the tie-break agree with the first")
    page.goto(env.url + "/admin/disputes")
    card = page.locator(f"[data-dispute='{d.id}']")
    assert card.locator("img.thumb").count() == 2
    shot(page, "07-dispute-open")
    card.locator(f"input[value='{sides[1]['provider_id']}']").check()
    card.locator("textarea[name=reason]").fill("tie-break provider used another dtype")
    card.locator("button[type=submit]").click()
    assert "dispute resolved" in page.locator(".flash.ok").inner_text()
    assert env.broker.services.disputes.get(d.id).resolution["winner_provider_id"] == sides[1]["provider_id"]
    page.goto(env.url + "/admin/disputes?state=resolved")
    assert "tie-break provider used another dtype" in page.content()
    shot(page, "08-dispute-resolved")


def test_overview_and_ledger_pages(env, console):
    page = console
    env.client.generate("echo", text="a job for the charts", timeout=30)  # one just finished
    swept = env.broker.services.retention.sweep()  # what the maintenance thread does
    page.goto(env.url + "/admin/")
    assert page.locator("svg.chart").count() == 5
    assert float(page.locator("#jpm").inner_text()) > 0
    storage = page.locator("#storage").inner_text().lower()  # storage used, as the last sweep saw it
    assert "storage used" in storage and f"{swept.blobs} blobs" in storage
    assert "local folder" in storage
    shot(page, "09-overview")
    page.goto(env.url + "/admin/ledger")
    assert "Ledger balanced" in page.locator("#reconcile").inner_text()
    shot(page, "10-ledger")
    page.click("a:text('client_available') >> nth=0")
    assert "balance" in page.content()
    shot(page, "11-ledger-account")


def test_audit_chain_verifies_and_points_at_a_tampered_row(env, console):
    page = console
    svc = env.broker.services
    # an entry of our own to tamper with: a price change with a value no other test sets
    svc.admin.change_price("swatch", {"min_charge_micro": 777_123}, by="audit-test")
    target = svc.audit.search(action="pricing.set", limit=1)[0].seq
    page.goto(env.url + "/admin/audit")
    page.click("#verify")
    assert "Chain intact" in page.locator("#verdict").inner_text()
    shot(page, "12-audit-ok")
    with svc.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE audit_log SET data = replace(data, '777123', '777124') "
                             f"WHERE seq = {target}")
    try:
        page.click("#verify")
        verdict = page.locator("#verdict").inner_text()
        assert f"Broken at entry #{target}" in verdict and "changed after it was written" in verdict
        shot(page, "13-audit-broken")
    finally:  # the chain is whole again for whoever looks next
        with svc.engine.begin() as conn:
            conn.exec_driver_sql("UPDATE audit_log SET data = replace(data, '777124', "
                                 f"'777123') WHERE seq = {target}")
    page.click("#verify")
    assert "Chain intact" in page.locator("#verdict").inner_text()


def test_logout_refuses_the_old_session(env, console):
    page = console
    cookie = next(c for c in env.context.cookies() if c["name"] == "sc_admin")
    page.goto(env.url + "/admin/")
    page.click("#logout")
    assert "/admin/login" in page.url and "You signed out" in page.content()
    page.goto(env.url + "/admin/ledger")
    assert "/admin/login" in page.url
    # replaying the old cookie is refused too: the session was revoked server-side
    env.context.add_cookies([cookie])
    r = env.context.request.get(env.url + "/admin/ledger", max_redirects=0)
    assert r.status == 302 and "/admin/login" in r.headers["location"]
    assert "why=ended" in r.headers["location"]  # "you signed out of this session"
