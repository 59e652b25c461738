"""The broker's /metrics (issue #25) on a real in-process broker with a real agent: what a
scrape shows after jobs ran, with Prometheus's own text parser."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sdk import Client


def scrape(url: str) -> dict[str, list]:
    """{family name: [(sample name, labels, value), ...]} of a /metrics answer."""
    resp = httpx.get(f"{url}/metrics", timeout=10)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples]
            for f in text_string_to_metric_families(resp.text)}


def value(families, sample: str, **labels) -> float:
    """The sum of the samples named ``sample`` whose labels include ``labels``."""
    family = sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    found = [v for name, have, v in families.get(family, [])
             if name == sample and all(have.get(k) == str(x) for k, x in labels.items())]
    assert found, f"no {sample}{labels} in {sorted(families)}"
    return sum(found)


def test_metrics_after_jobs_ran(live_broker, start_agent):
    start_agent("metered", slots=2)
    with Client(live_broker.url, live_broker.key("client")) as client:
        for i in range(3):
            assert client.generate("echo", text=f"hello {i}").job.state == "settled"
        client.plugins()
        httpx.get(f"{live_broker.url}/v1/jobs/not-a-job",
                  headers={"Authorization": f"Bearer {client.api_key}"}, timeout=10)
    m = scrape(live_broker.url)
    assert value(m, "sparecycles_jobs_submitted_total", plugin="echo") == 3
    assert value(m, "sparecycles_jobs_finished_total", plugin="echo", state="settled") == 3
    assert value(m, "sparecycles_job_duration_seconds_count", plugin="echo",
                 state="settled") == 3
    assert value(m, "sparecycles_job_placement_seconds_count", plugin="echo") >= 3
    assert value(m, "sparecycles_job_settlement_seconds_count", plugin="echo") == 3
    # Routes are the rules, not the paths (a job id never becomes a label).
    assert value(m, "sparecycles_http_requests_total", route="/v1/jobs", method="POST") == 3
    assert value(m, "sparecycles_http_requests_total", route="/v1/jobs/<job_id>",
                 method="GET", status=404) == 1
    assert not any("not-a-job" in str(labels) for _, labels, _ in
                   m["sparecycles_http_requests"])
    assert value(m, "sparecycles_http_request_duration_seconds_count", route="/v1/plugins",
                 method="GET") == 1
    assert value(m, "sparecycles_agents_connected") == 1
    assert value(m, "sparecycles_agent_slots", plugin="echo") == 2
    assert value(m, "sparecycles_agent_free_slots", plugin="echo") == 2
    assert value(m, "sparecycles_ledger_postings_total", kind="post") == 3
    assert value(m, "sparecycles_ledger_transactions_total", kind="post") == 3
    assert value(m, "sparecycles_provider_earnings_credits_total") > 0
    assert value(m, "sparecycles_blob_written_bytes_total", store="jobs") > 0
    assert value(m, "sparecycles_metrics_database_up") == 1
    assert value(m, "sparecycles_broker_info")  == 1
    assert value(m, "sparecycles_agent_heartbeats_total") >= 0
    assert "sparecycles_queue_depth_jobs" in m and "sparecycles_disputes" in m


def test_queue_depth_and_age_come_from_the_database(tmp_path):
    import time

    from tests.integration.conftest import LiveBroker, seen_provider

    broker = LiveBroker(tmp_path, metrics_db_interval_s=0)
    try:
        seen_provider(broker.services)  # known, not connected: the jobs stay queued
        with Client(broker.url, broker.key("client")) as client:
            for _ in range(2):
                client.jobs.create("echo", text="wait for me")
        time.sleep(0.3)
        m = scrape(broker.url)
        assert value(m, "sparecycles_queue_depth_jobs", plugin="echo") == 2
        assert value(m, "sparecycles_jobs", state="queued", plugin="echo") == 2
        assert value(m, "sparecycles_queue_oldest_age_seconds", plugin="echo") >= 0.25
    finally:
        broker.stop()


def test_cli_generate_follows_progress_then_saves(live_broker, start_agent, tmp_path):
    """`sparecycles generate` (a real process) prints the job's steps off a terminal."""
    import os
    import subprocess

    from sdk.localnet import cli

    start_agent("cli")
    out = subprocess.run(cli("generate", "echo", "--set", "text=hi", "--set", "steps=3",
                             "--set", "sleep_ms=30", "--out", str(tmp_path / "o.json")),
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SPARECYCLES_URL": live_broker.url,
                              "SPARECYCLES_API_KEY": live_broker.key("client")})
    assert out.returncode == 0, out.stderr
    assert "step 3/3" in out.stderr and "queued" in out.stderr
    assert (tmp_path / "o.json").exists() or list(tmp_path.glob("o*.json"))


@pytest.mark.postgres
def test_two_replicas_add_up(tmp_path, pg_url):
    """Two broker replicas on one PostgreSQL database: events are counted where they
    happen (sum over replicas), the shared queue is the same on both (take max)."""
    from tests.integration.conftest import LiveBroker, seen_provider

    import base64
    import os

    # replicas share the signing key and the at-rest key (docs/architecture.md, *Replicas*)
    shared = {"key_path": tmp_path / "broker.key",
              "at_rest_key": base64.b64encode(os.urandom(32)).decode()}
    a = LiveBroker(tmp_path / "a", db_url=pg_url, metrics_db_interval_s=0,
                   replica_name="replica-a", **shared)
    b = LiveBroker(tmp_path / "b", db_url=pg_url, metrics_db_interval_s=0,
                   replica_name="replica-b", **shared)
    try:
        seen_provider(a.services)  # known, not connected: the jobs stay queued
        key = a.key("client")
        with Client(a.url, key) as on_a, Client(b.url, key) as on_b:
            on_a.jobs.create("echo", text="1")
            on_a.jobs.create("echo", text="2")
            on_b.jobs.create("echo", text="3")
        ma, mb = scrape(a.url), scrape(b.url)
        assert value(ma, "sparecycles_broker_info", replica="replica-a") == 1
        assert value(mb, "sparecycles_broker_info", replica="replica-b") == 1
        assert value(ma, "sparecycles_jobs_submitted_total", plugin="echo") == 2
        assert value(mb, "sparecycles_jobs_submitted_total", plugin="echo") == 1
        for m in (ma, mb):
            assert value(m, "sparecycles_queue_depth_jobs", plugin="echo") == 3
            assert value(m, "sparecycles_ledger_transactions_total", kind="hold") == 3
    finally:
        a.stop()
        b.stop()
