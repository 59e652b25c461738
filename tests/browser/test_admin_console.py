"""The admin console in a real browser (Debian's headless Chromium driven by Playwright)
against a live broker with two real in-process agents on loopback.

The tests run in file order and share one broker: each step builds on the last, as an
admin's session would. Screenshots of every page go to artifacts/screenshots/.
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
        e.state = {}
        yield e
    stop_all()
    broker.stop()


def test_login_refuses_bad_keys_and_accepts_an_admin_key(env):
    page = env.page
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
    env.state["cookie"] = cookie
    # a form without the CSRF token is refused and changes nothing
    r = env.context.request.post(env.url + "/admin/pricing/echo",
                                 form={"reserve_micro_per_unit": "9"}, max_redirects=0)
    assert r.status == 403 and "Form expired" in r.text()
    assert env.broker.services.pricing.price("echo").is_default


def test_reserve_price_change_is_used_by_the_next_quote(env):
    page = env.page
    before = env.client.quote("echo", text="hi")
    page.goto(env.url + "/admin/pricing")
    card = page.locator("form[data-plugin=echo]")
    card.locator("input[name=reserve_micro_per_unit]").fill("0.0042")
    card.locator("input[name=min_stake_micro]").fill("25")
    card.locator("button[type=submit]").click()
    assert "echo: saved" in page.locator(".flash.ok").inner_text()
    after = env.client.quote("echo", text="hi")
    assert before["price"]["reserve_micro_per_unit"] == 1000
    assert after["price"]["reserve_micro_per_unit"] == 4200
    assert after["max_micro"] == max(4200, after["price"]["min_charge_micro"])
    # the change is audited with before and after
    assert "1000 → 4200" in page.locator("section.card").last.inner_text()
    shot(page, "02-pricing")
    # a bad value is refused with a clear message, nothing saved
    card = page.locator("form[data-plugin=echo]")
    card.locator("input[name=fee_bps]").fill("lots")
    card.locator("button[type=submit]").click()
    assert "nothing saved" in page.locator(".flash.error").inner_text()
    assert env.broker.services.pricing.price("echo").fee_bps == 1000


def test_paused_provider_receives_no_new_jobs(env):
    page = env.page
    page.goto(env.url + "/admin/providers")
    assert page.locator("tr[data-provider]").count() == 2
    shot(page, "03-providers")
    page.click(f"tr[data-provider='{env.alpha.provider_id}'] a")
    page.fill("textarea[name=reason]", "suspicious outputs (test)")
    page.click("button[value=pause]")
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


def test_job_page_shows_image_and_receipt(env):
    page = env.page
    a = env.client.jobs.create("swatch", color="e5484d")
    b = env.client.jobs.create("swatch", color="30a46c")
    for j in (a, b):
        j.wait(timeout=30)
    env.state["swatches"] = [a.id, b.id]
    page.goto(env.url + "/admin/jobs?plugin=swatch")
    assert page.locator("table.jobs tbody tr").count() == 2
    shot(page, "05-jobs")
    page.goto(env.url + f"/admin/jobs/{a.id}")
    img = page.locator("img.thumb").first
    img.wait_for()
    assert page.evaluate("(el) => el.complete && el.naturalWidth", img.element_handle()) == 64
    receipt = page.locator("#receipt").inner_text()
    assert a.id in receipt and "envelope_sha256" in receipt
    assert "ledger.post" in page.content()  # the settlement is in the job's audit trail
    shot(page, "06-job")


def test_admin_resolves_a_dispute(env):
    page = env.page
    page.goto(env.url + "/admin/disputes")
    assert "No open disputes" in page.content()
    repo = env.broker.services.jobs.repo
    first, second = (repo.get(i) for i in env.state["swatches"])
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


def test_overview_and_ledger_pages(env):
    page = env.page
    page.goto(env.url + "/admin/")
    assert page.locator("svg.chart").count() == 5
    assert float(page.locator("#jpm").inner_text()) > 0
    shot(page, "09-overview")
    page.goto(env.url + "/admin/ledger")
    assert "Ledger balanced" in page.locator("#reconcile").inner_text()
    shot(page, "10-ledger")
    page.click("a:text('client_available') >> nth=0")
    assert "balance" in page.content()
    shot(page, "11-ledger-account")


def test_audit_chain_verifies_and_points_at_a_tampered_row(env):
    page = env.page
    page.goto(env.url + "/admin/audit")
    page.click("#verify")
    assert "Chain intact" in page.locator("#verdict").inner_text()
    shot(page, "12-audit-ok")
    target = env.broker.services.audit.search(action="pricing.set", limit=1)[0].seq
    with env.broker.services.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE audit_log SET data = replace(data, '4200', '42') "
                             f"WHERE seq = {target}")
    page.click("#verify")
    verdict = page.locator("#verdict").inner_text()
    assert f"Broken at entry #{target}" in verdict and "changed after it was written" in verdict
    shot(page, "13-audit-broken")


def test_logout_refuses_the_old_session(env):
    page = env.page
    page.goto(env.url + "/admin/")
    page.click("#logout")
    assert "/admin/login" in page.url and "You signed out" in page.content()
    page.goto(env.url + "/admin/ledger")
    assert "/admin/login" in page.url
    # replaying the old cookie is refused too: the session was revoked server-side
    env.context.add_cookies([env.state["cookie"]])
    r = env.context.request.get(env.url + "/admin/ledger", max_redirects=0)
    assert r.status == 302 and "/admin/login" in r.headers["location"]
    assert "why=ended" in r.headers["location"]  # "you signed out of this session"
