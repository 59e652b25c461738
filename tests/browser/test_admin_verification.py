"""Verification in the admin console, in a real browser (Debian's headless Chromium driven
by Playwright) against a live broker with verification on and three in-process agents on
loopback: one job verified by a second provider, one overturned 2-to-1 because its
provider cheated. The job pages show the status, the runs side by side and the comparison
figures; the provider pages show CV and claimed vs measured throughput; the dispute page
shows the three sides. Screenshots go to artifacts/screenshots/ (14- onwards).
"""
from __future__ import annotations

import time

import pytest

from broker.ledger.seeding import seed_earned
from tests.browser.conftest import FIXTURE_PLUGINS, SHOTS, chromium_page, shot
from tests.fixtures.plugins.swatch.plugin import png
from tests.integration.conftest import LiveBroker, agent_starter

pytestmark = pytest.mark.timeout(180)


#: What the cheater returns instead of the swatch it was asked for: a cheap flat image.
FAKE_PNG = png(64, 64, lambda x, y: (79, 124, 255) if (x // 16 + y // 16) % 2 else (60, 90, 200))


def _canary_answer_known(svc) -> bool:
    """Whether providers of two operators returned the same canary answer (then a canary
    that disagrees is a lost check)."""
    from sqlalchemy import select

    from broker.storage.verification_sql import CanaryAnswerRow
    with svc.engine.connect() as c:
        return any(len(ops) >= 2 for ops in c.scalars(select(CanaryAnswerRow.operators)))


def _wait(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from broker.settings import BUILTIN_PLUGINS
    from sdk.client import Client

    broker = LiveBroker(tmp_path_factory.mktemp("console-verify"),
                        plugin_dirs=[BUILTIN_PLUGINS, FIXTURE_PLUGINS],
                        verification=True, check_delay_max_s=0.0)
    svc = broker.services
    start, stop_all = agent_starter(broker)
    swatch = {"swatch": FIXTURE_PLUGINS / "swatch"}
    agents = []
    try:
        client = Client(broker.url, broker.key("client", credits=1000))
        status = lambda job_id: getattr(svc.verification.status(job_id), "status", None)  # noqa: E731

        # 1. A new provider's job is always checked; the check goes to the other operator.
        agents.append(start("alpha", plugins=swatch))
        verified = client.jobs.create("swatch", color="e5484d")
        verified.wait(timeout=30)
        agents.append(start("bravo", plugins=swatch))
        _wait(lambda: status(verified.id) and status(verified.id).value == "verified",
              what="the first job to be verified")

        # Every new agent runs a first canary. Once the two honest operators agreed on its
        # answer, a canary that disagrees is a lost check: wait for that, so that the
        # cheater's made-up canary always counts (it used to count only when the honest
        # canaries happened to finish first).
        _wait(lambda: _canary_answer_known(svc), what="the honest operators' canaries to agree")

        # 2. A cheater (with 5 credits at stake) runs the next job alone; the honest two
        #    are paused meanwhile, then resumed to check it and break the tie.
        cheater_key = broker.key("provider")
        seed_earned(svc.ledger, svc.auth.authenticate(cheater_key).account_id, 5_000_000)
        # returns a made-up image instead of running the model
        agents.append(start("mallory", key=cheater_key, plugins=swatch,
                            cheat=lambda data: FAKE_PNG))
        honest = [a.provider_id for a in agents[:2]]
        for pid in honest:
            svc.admin.provider_action(pid, "pause", "test: let the cheater take the job", by="test")
        overturned = client.jobs.create("swatch", color="30a46c")
        overturned.wait(timeout=30)
        assert svc.jobs.repo.get(overturned.id).provider_id == agents[2].provider_id
        for pid in honest:
            svc.admin.provider_action(pid, "resume", "test: check the cheater", by="test")
        _wait(lambda: status(overturned.id) and status(overturned.id).value == "overturned",
              timeout=90, what="the cheater's job to be overturned")
        _wait(lambda: sum(r.failures for r in
                          svc.verification.repo.standings(agents[2].provider_id)) >= 2,
              what="the cheater's canary and its lost dispute to be counted")
    except BaseException:
        stop_all()
        broker.stop()
        raise

    with chromium_page() as (_, _, page):
        class Env:
            pass
        e = Env()
        e.broker, e.svc, e.page, e.url = broker, svc, page, broker.url
        e.alpha, e.bravo, e.cheater = agents
        e.verified, e.overturned = verified.id, overturned.id
        page.goto(e.url + "/admin/login")
        page.fill("input[name=api_key]", broker.key("admin"))
        page.click("button[type=submit]")
        assert page.url.endswith("/admin/")
        yield e
    stop_all()
    broker.stop()


def _loaded(page, img) -> int:
    img.wait_for()
    page.wait_for_function("(el) => el.complete", arg=img.element_handle())
    return page.evaluate("(el) => el.naturalWidth", img.element_handle())


def test_verified_job_shows_its_check_and_the_figures(env):
    page = env.page
    page.goto(env.url + f"/admin/jobs/{env.verified}")
    assert page.locator("#vstatus").inner_text() == "verified"
    assert "p = 100%" in page.locator("#vp").inner_text()
    assert "new provider" in page.locator("#vreason").inner_text()
    runs = page.locator("#vruns tbody tr")
    assert runs.count() == 2
    check = env.svc.jobs.repo.checks_of(env.verified)[0]
    checker_row = page.locator("#vruns tr[data-role=checker]")
    assert check.id[:8] in checker_row.inner_text()
    assert "bravo" in checker_row.inner_text() and "confirmed" in checker_row.inner_text().lower()
    # both outputs side by side, each as its provider signed it
    sides = page.locator("#vsides img.thumb")
    assert sides.count() == 2
    assert all(_loaded(page, sides.nth(i)) == 64 for i in range(2))
    figures = page.locator("#vfigures")
    assert "primary ↔ checker" in figures.inner_text()
    assert figures.locator("[data-fig=ssim]").inner_text() == "1.0000"
    assert figures.locator("[data-fig=psnr_db]").inner_text() == "identical"
    assert figures.locator("[data-fig=phash_bits]").inner_text() == "0 / 64"
    assert "the check agrees" in page.locator("#voutcome").inner_text()
    shot(page, "14-job-verified")
    # the check's own page says what it is and links back
    checker_row.locator("a.mono").click()
    assert "checker run of job" in page.locator("#verification").inner_text()
    page.locator("#verification a.mono").click()
    assert page.url.endswith(f"/admin/jobs/{env.verified}")


def test_overturned_job_shows_three_runs_the_figures_and_the_penalty(env):
    page = env.page
    page.goto(env.url + f"/admin/jobs/{env.overturned}")
    assert page.locator("#vstatus").inner_text() == "overturned"
    assert "majority's output" in page.locator(".note.warn").inner_text()
    roles = page.locator("#vruns tbody tr")
    assert [roles.nth(i).get_attribute("data-role") for i in range(roles.count())] == [
        "primary", "checker", "tiebreaker"]
    primary = page.locator("#vruns tr[data-role=primary]").inner_text().lower()
    assert "mallory" in primary and "outvoted" in primary
    # three outputs side by side; the primary's is the made-up one the client first got
    sides = page.locator("#vsides img.thumb")
    assert sides.count() == 3
    assert all(_loaded(page, sides.nth(i)) == 64 for i in range(3))
    first = page.locator("#vsides [data-role=primary] img").get_attribute("src")
    assert env.svc.jobs.blobs.get(env.svc.jobs.repo.get(env.overturned).receipt["outputs"][0]["sha256"]) \
        == FAKE_PNG
    assert page.context.request.get(env.url + first).body() == FAKE_PNG
    figures = page.locator("#vfigures tbody tr")
    assert figures.count() == 3
    text = page.locator("#vfigures").inner_text()
    assert "primary ↔ checker" in text and "checker ↔ tiebreaker" in text
    verdicts = [figures.nth(i).locator(".verdict-chip").inner_text().lower() for i in range(3)]
    assert verdicts == ["mismatch", "mismatch", "match"]  # the cheater's against the others'
    assert figures.nth(2).locator("[data-fig=ssim]").inner_text() == "1.0000"
    outcome = page.locator("#voutcome").inner_text()
    assert "outvoted" in outcome and "mallory" in outcome
    assert "2.5" in outcome  # half of its 5 credits of stake slashed
    shot(page, "15-job-overturned")


def test_providers_show_cv_quota_and_claimed_vs_measured_throughput(env):
    page = env.page
    page.goto(env.url + "/admin/providers")
    cheater = page.locator(f"tr[data-provider='{env.cheater.provider_id}'] [data-cv]").inner_text()
    # its made-up first canary and the dispute it lost: two lost checks, quota halved twice
    assert cheater.startswith("0") and "2 lost" in cheater and "quota ×0.25" in cheater
    alpha = page.locator(f"tr[data-provider='{env.alpha.provider_id}'] [data-cv]").inner_text()
    assert alpha.startswith("2")  # its job verified, then one of the majority on the cheater's
    shot(page, "16-providers-cv")

    page.goto(env.url + f"/admin/providers/{env.alpha.provider_id}")
    assert page.locator("#provider-cv").inner_text() == "2"
    row = page.locator("#standing tr[data-standing=swatch]")
    assert row.locator("[data-cv]").inner_text() == "2"
    theta = page.locator("#throughput tr[data-plugin=swatch]")
    assert "u/s" in theta.locator("[data-theta=claimed]").inner_text()
    assert "sample" in theta.locator("[data-theta=measured]").inner_text()
    shot(page, "17-provider-verification")

    page.goto(env.url + f"/admin/providers/{env.cheater.provider_id}")
    assert page.locator("#provider-cv").inner_text() == "0"
    assert page.locator("#provider-stake").inner_text() == "2.5"
    assert "×0.25" in page.locator("#standing").inner_text()  # its canary and its dispute
    shot(page, "18-provider-cheater")


def test_dispute_from_verification_shows_the_sides_and_can_be_overridden(env):
    page = env.page
    page.goto(env.url + "/admin/disputes")
    d = next(x for x in env.svc.disputes.list("open") if x.job_id == env.overturned)
    card = page.locator(f"[data-dispute='{d.id}']")
    roles = card.locator("figure.dside")
    assert [roles.nth(i).get_attribute("data-side") for i in range(3)] == [
        "primary", "checker", "tiebreaker"]
    assert "minority" in card.locator("figure[data-side=primary]").get_attribute("class")
    assert card.locator("img.thumb").count() == 3
    assert all(_loaded(page, card.locator("img.thumb").nth(i)) == 64 for i in range(3))
    assert card.locator("table.cmp-table tbody tr").count() == 3
    assert "SSIM" in card.locator("table.cmp-table").inner_text()
    # what the image bounds were set between (issue #20): honest pairs and each cheat
    calibration = page.locator("#calibration-table").inner_text()
    assert "honest pairs" in calibration and "fewer-steps" in calibration
    assert "reject" in page.locator("#image-calibration").inner_text()
    page.locator("#image-calibration").screenshot(path=str(SHOTS / "19-image-calibration.png"))
    shot(page, "19-dispute-verification")
    # an override without a reason is refused by the form; with one it is recorded
    card.locator("button[type=submit]").click()
    assert env.svc.disputes.get(d.id).state == "open"
    card.locator("textarea[name=reason]").fill("looked at both images: the majority is right")
    card.locator("button[type=submit]").click()
    assert "dispute resolved" in page.locator(".flash.ok").inner_text()
    resolution = env.svc.disputes.get(d.id).resolution
    assert resolution["winner_provider_id"] != env.cheater.provider_id  # the majority was preselected
    assert resolution["reason"] == "looked at both images: the majority is right"


def test_overview_has_a_verification_panel(env):
    page = env.page
    page.goto(env.url + "/admin/")
    panel = page.locator("#verification-panel")
    assert int(panel.locator("#v-checks").inner_text()) == 3  # one check, one check + tie-break
    assert int(panel.locator("#v-verified").inner_text()) == 1
    assert int(panel.locator("#v-disputed").inner_text()) == 1  # went to a third run
    assert int(panel.locator("#v-overturned").inner_text()) == 1
    assert panel.locator("#v-overhead").inner_text() == "150%"  # 3 check jobs ÷ 2 client jobs
    assert panel.locator("svg.vbar rect").count() == 2
    shot(page, "20-overview-verification")


def test_jobs_list_marks_verification_and_check_runs(env):
    page = env.page
    page.goto(env.url + "/admin/jobs?plugin=swatch")
    rows = page.locator("table.jobs tbody tr")
    assert rows.count() == 5  # two client jobs, one check, one check + tie-break
    text = {rows.nth(i).locator("a.mono").first.inner_text(): rows.nth(i).inner_text()
            for i in range(rows.count())}
    assert "overturned" in text[env.overturned[:8]] and "verified" in text[env.verified[:8]]
    checks = [t for t in text.values() if " of " in t]
    assert sorted(t.split("\t")[3].split(" of ")[0].strip() for t in checks) == [
        "checker", "checker", "tiebreaker"]
    shot(page, "21-jobs-verification")
