"""A real Prometheus server (Debian's ``prometheus``, installed by ``make system-deps``)
scrapes a live broker and agent (real processes on loopback) while jobs run; the job
counters and a latency histogram are read back through Prometheus's HTTP query API
(issue #25). Skipped, saying why, where the binary is missing, unless
SPARECYCLES_REQUIRE_PROMETHEUS=1 (CI) makes that a failure."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import httpx
import pytest


PROMETHEUS = shutil.which("prometheus")
JOBS = 6

if PROMETHEUS is None and os.environ.get("SPARECYCLES_REQUIRE_PROMETHEUS") == "1":
    raise RuntimeError("SPARECYCLES_REQUIRE_PROMETHEUS=1 but no prometheus binary: run "
                       "`make system-deps` as root (apt-get install prometheus)")

pytestmark = [pytest.mark.e2e, pytest.mark.localnet(lease_timeout_s=3),
              pytest.mark.skipif(PROMETHEUS is None, reason=(
                  "no prometheus binary: `make system-deps` installs it as root "
                  "(apt-get install prometheus); SPARECYCLES_REQUIRE_PROMETHEUS=1 fails "
                  "instead of skipping"))]


def _free_port(lo: int = 25000, hi: int = 25999) -> int:
    """A free loopback port in this test's range."""
    for port in range(lo, hi):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {lo}-{hi}")


def _query(prom: str, expr: str) -> list:
    resp = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=5)
    resp.raise_for_status()
    body = resp.json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def _until(fn, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def test_prometheus_scrapes_broker_and_agent(localnet, tmp_path):
    info = localnet.start_broker()
    # the e2e network serves TLS (issue #23): Prometheus scrapes over https, trusting its CA
    scheme, _, broker_target = info["http"].partition("://")
    tls = (f"\n    scheme: https\n    tls_config: {{ca_file: \"{localnet.ca_file}\"}}"
           if scheme == "https" else "")
    agent_port = _free_port()
    localnet.start_agent("scraped", localnet.create_key("provider"), sandbox=False,
                         run_args=["--metrics-addr", f"127.0.0.1:{agent_port}"])
    localnet.wait_for_providers(1)
    prom_port = _free_port(lo=agent_port + 1)
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: sparecycles-broker{tls}
    static_configs: [{{targets: ["{broker_target}"]}}]
  - job_name: sparecycles-agents
    static_configs: [{{targets: ["127.0.0.1:{agent_port}"]}}]
""")
    check = subprocess.run([shutil.which("promtool") or "promtool", "check", "config",
                            str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={config}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{prom_port}"
    try:
        _until(lambda: httpx.get(f"{url}/-/ready", timeout=2).status_code == 200,
               "Prometheus to be ready")
        with localnet.client(localnet.create_key("client")) as client:
            for i in range(JOBS):
                assert client.generate("echo", text=f"scraped {i}").job.state == "settled"
        settled = _until(lambda: [r for r in _query(
            url, 'sum(sparecycles_jobs_finished_total{state="settled"})')
            if float(r["value"][1]) >= JOBS], "the settled jobs' counter in Prometheus")
        assert float(settled[0]["value"][1]) == JOBS
        submitted = _query(url, 'sum(sparecycles_jobs_submitted_total{plugin="echo"})')
        assert float(submitted[0]["value"][1]) == JOBS
        # The latency histogram: its count and a quantile Prometheus computes from buckets.
        count = _query(url, 'sum(sparecycles_job_duration_seconds_count{state="settled"})')
        assert float(count[0]["value"][1]) == JOBS
        p95 = _query(url, 'histogram_quantile(0.95, sum by (le) '
                          '(sparecycles_job_duration_seconds_bucket{state="settled"}))')
        assert 0 < float(p95[0]["value"][1]) < 60
        # Both targets up (a scrape on a loaded machine may time out now and then: the
        # latest one counts); the agent's own metrics (its job counter and machine) too.
        up = _until(lambda: (lambda got: got if got == {"sparecycles-broker": "1",
                                                        "sparecycles-agents": "1"} else None)(
            {r["metric"]["job"]: r["value"][1] for r in _query(url, "up")}), "both targets up")
        assert set(up) == {"sparecycles-broker", "sparecycles-agents"}
        done = _until(lambda: _query(
            url, 'sum(sparecycles_agent_jobs_total{outcome="done"})'), "agent job counter")
        assert float(done[0]["value"][1]) >= JOBS
        assert _query(url, "sparecycles_agent_memory_total_bytes")
    finally:
        prom.terminate()
        try:
            prom.wait(10)
        except subprocess.TimeoutExpired:
            prom.kill()
        log.close()
