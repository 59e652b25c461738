"""What the admin console's browser tests share: Debian's headless Chromium driven by
Playwright (every test here is skipped, with the reason, when either is missing), where
screenshots go, and the test plugins' folder."""
from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "artifacts" / "screenshots"
FIXTURE_PLUGINS = ROOT / "tests" / "fixtures" / "plugins"

playwright_api = pytest.importorskip("playwright.sync_api",
                                     reason="playwright is not installed: pip install -e .[dev]")
if not Path(CHROMIUM).exists() and not shutil.which("chromium"):
    pytest.skip("chromium is missing (apt-get install chromium, or `make system-deps`); the "
                "console's browser tests need Debian's headless Chromium", allow_module_level=True)


@contextmanager
def chromium_page():
    """(browser, context, page): a headless Chromium with one 1360×900 page whose actions
    time out after 10 s; closed on leaving. Makes sure SHOTS exists."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    with playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            context = browser.new_context(viewport={"width": 1360, "height": 900})
            page = context.new_page()
            page.set_default_timeout(10_000)
            yield browser, context, page
        finally:
            browser.close()


def shot(page, name):
    """A full-page screenshot to SHOTS/``name``.png."""
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
