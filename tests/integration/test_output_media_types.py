"""Job outputs carry a media type their provider chose: the API and the admin console serve
only png, jpeg, webp, plain text and JSON as themselves; anything else (HTML, SVG…) is an
attachment of application/octet-stream, and every output is sandboxed and nosniff."""
import pytest

from broker.app import create_app
from broker.admin.session import COOKIE
from broker.jobs.model import JobOutput
from broker.services import build_services
from broker.settings import Settings

EVIL = b"<html><script>fetch('/admin/keys', {method: 'POST'})</script></html>"


@pytest.fixture
def env(tmp_path):
    services = build_services(Settings(data_dir=tmp_path, verification=False))
    app = create_app(services)
    key, _ = services.auth.create_account_with_key("client")
    api = app.test_client()
    api.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {key}"
    admin_key, _ = services.auth.create_account_with_key("admin")
    token, _ = services.admin_sessions.login(admin_key)
    console = app.test_client()
    console.set_cookie(COOKIE, token, path="/admin")
    yield api, console, services
    services.engine.dispose()


CASES = [("text/html", "application/octet-stream", True),
         ("image/svg+xml", "application/octet-stream", True),
         ("application/xhtml+xml", "application/octet-stream", True),
         ("", "application/octet-stream", True),
         ("text/plain", "text/plain; charset=utf-8", False),
         ("Text/Plain; charset=latin-1", "text/plain; charset=utf-8", False),
         ("application/json", "application/json", False),
         ("image/png", "image/png", False),
         ("image/jpeg", "image/jpeg", False),
         ("image/webp", "image/webp", False)]


def _check(resp, served: str, attachment: bool) -> None:
    assert resp.status_code == 200 and resp.data == EVIL
    assert resp.headers["Content-Type"] == served
    assert (resp.headers.get("Content-Disposition") == "attachment") is attachment
    assert "sandbox" in resp.headers["Content-Security-Policy"]
    assert resp.headers["X-Content-Type-Options"] == "nosniff"


def test_the_api_serves_only_safe_types_as_themselves(env, monkeypatch):
    api, _, services = env
    sha = services.jobs.blobs.put(EVIL)
    for media_type, served, attachment in CASES:
        out = JobOutput("job-1", 0, sha, media_type, len(EVIL))
        monkeypatch.setattr(services.jobs, "output", lambda who, job_id, index: (out, EVIL))
        resp = api.get("/v1/jobs/job-1/outputs/0")
        _check(resp, served, attachment)
        assert resp.headers["X-Content-SHA256"] == sha


def test_the_console_serves_only_safe_types_as_themselves(env, monkeypatch):
    _, console, services = env
    sha = services.jobs.blobs.put(EVIL)
    monkeypatch.setattr(services.jobs.repo, "get", lambda job_id: object())
    for media_type, served, attachment in CASES:
        monkeypatch.setattr(services.jobs.repo, "outputs", lambda job_id, m=media_type: [
            JobOutput(job_id, 0, sha, m, len(EVIL))])
        monkeypatch.setattr(services.admin, "run_outputs", lambda job, m=media_type: [
            {"index": 0, "sha256": sha, "media_type": m}])
        for path in ("/admin/jobs/job-1/outputs/0", "/admin/jobs/job-1/runs/0"):
            resp = console.get(path)
            _check(resp, served, attachment)
            csp = resp.headers["Content-Security-Policy"]
            assert csp.endswith("; sandbox") and "default-src 'self'" in csp
