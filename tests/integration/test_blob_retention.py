"""Retention of job blobs (issue #24) on the local folder and on S3: outputs expire after the
retention time, checkpoints when their job ends, uploads nobody names after a grace period;
what is live stays."""
from __future__ import annotations

import time

import httpx
import pytest

from broker.blobs.retention import BlobRetention, RetentionPolicy
from broker.jobs.checkpoints import CheckpointRecord
from sdk import Client
from tests.integration.conftest import LiveBroker, agent_starter
from tests.integration.test_s3_outputs import s3_settings


@pytest.fixture(params=["local", "s3"])
def broker(request, tmp_path):
    extra = {} if request.param == "local" else s3_settings(
        request.getfixturevalue("s3_endpoint"))
    b = LiveBroker(tmp_path, **extra)
    yield b
    b.stop()


def _checkpoint(services, job_id: str, data: bytes) -> str:
    sha = services.jobs.blobs.put(data)
    services.jobs.checkpoints.repo.save(CheckpointRecord(
        job_id=job_id, attempt=0, provider_id="p", base_step=0, step=1, total=4, sha256=sha,
        size=len(data), rate_micro_per_unit=None, created_at=time.time()))
    return sha


def test_the_sweep_keeps_what_is_live_and_deletes_what_expired(broker):
    services = broker.services
    start, stop_all = agent_starter(broker)
    client = Client(broker.url, broker.key("client"))
    try:
        start("a")
        done = client.generate("echo", text="kept a week")
    finally:
        stop_all()
    queued = client.jobs.create("echo", text="waits")  # nobody connected: it stays queued
    blobs = services.jobs.blobs
    output = done.outputs[0]["sha256"]
    spent = _checkpoint(services, done.job.id, b"checkpoint of a settled job")
    running = _checkpoint(services, queued.id, b"checkpoint of a queued job")
    orphan = blobs.put(b"an upload whose receipt never came")
    week, hour = 7 * 24 * 3600.0, 3600.0
    now = time.time()

    def sweep(after_s: float):
        r = BlobRetention(blobs, services.retention.refs, RetentionPolicy(
            output_retention_s=week, orphan_grace_s=hour), clock=lambda: now + after_s)
        return r.sweep()

    report = sweep(0)  # the spent checkpoint goes at once; the young orphan may be an upload
    assert report.deleted == 1 and report.by_reason == {"expired": 1}
    assert not blobs.exists(spent)
    assert all(blobs.exists(k) for k in (output, running, orphan))
    assert (report.blobs, report.bytes) == blobs.usage()

    # Past the grace: the orphan goes (on S3 with the canary's output, which the agent PUT
    # like any other and no job names), the rest stays.
    report = sweep(hour + 1)
    assert set(report.by_reason) == {"orphan"} and not blobs.exists(orphan)
    assert report.deleted == (2 if blobs.presigns else 1)
    assert blobs.exists(output) and blobs.exists(running)

    report = sweep(week + 1)  # past retention: the output goes; the queued job's stays
    assert report.by_reason == {"expired": 1}
    assert not blobs.exists(output) and blobs.exists(running)
    n, size = blobs.usage()  # the local folder seals what it keeps: a few bytes more
    assert n == 1 and size >= len(b"checkpoint of a queued job")


def test_an_expired_output_answers_410_and_the_job_says_so(tmp_path):
    b = LiveBroker(tmp_path, output_retention_s=1.0)
    start, stop_all = agent_starter(b)
    try:
        start("a")
        client = Client(b.url, b.key("client"))
        result = client.generate("echo", text="short-lived")
        assert result.output_bytes(0)
    finally:
        stop_all()
    time.sleep(1.2)
    report = b.services.retention.sweep()
    assert report.deleted >= 1 and not b.services.jobs.blobs.exists(result.outputs[0]["sha256"])
    job = client.jobs.get(result.job.id)
    assert job.data["outputs"][0]["expired"] is True
    r = httpx.get(f"{b.url}/v1/jobs/{job.id}/outputs/0",
                  headers={"Authorization": f"Bearer {client.api_key}"})
    assert r.status_code == 410 and r.json()["code"] == "output_expired"
    assert "output_retention_s" in r.json()["detail"]
    b.stop()
