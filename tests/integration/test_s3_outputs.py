"""Outputs on S3 (issue #24): a live broker whose blob store is a real S3 API (moto's server in
its own process), real agents that PUT their outputs with presigned URLs, and the SDK that
downloads them straight from storage."""
from __future__ import annotations

import hashlib
import json
import uuid

import httpx
import pytest

from sdk import Client
from sdk.protocol import agent_pb2 as pb
from sdk.protocol.canonical import canonical_bytes
from sdk.protocol.envelope import make_receipt
from sdk.protocol.signing import KeyPair
from tests.conftest import S3_TEST_KEYS
from tests.integration.conftest import LiveBroker, agent_starter
from tests.integration.test_gateway_and_sdk import RawAgent, _handshake


def s3_settings(endpoint: str, **extra) -> dict:
    return {"blob_store": "s3", "s3_bucket": f"sc-{uuid.uuid4().hex[:16]}",
            "s3_endpoint": endpoint, "s3_region": "us-east-1", "s3_path_style": True,
            "s3_access_key_id": S3_TEST_KEYS["access_key_id"],
            "s3_secret_access_key": S3_TEST_KEYS["secret_access_key"], **extra}


@pytest.fixture
def s3_broker(tmp_path, s3_endpoint):
    b = LiveBroker(tmp_path, **s3_settings(s3_endpoint))
    yield b
    b.stop()


def _local_blobs(broker) -> list:
    folder = broker.settings.blob_dir
    return [p for p in folder.rglob("*") if p.is_file() and "registry" not in p.parts] \
        if folder.exists() else []


def test_an_agent_puts_its_outputs_into_s3_and_the_client_downloads_them_from_there(s3_broker):
    start, stop_all = agent_starter(s3_broker)
    try:
        agent = start("direct")
        assert agent.direct_uploads  # the broker's Welcome said so
        client = Client(s3_broker.url, s3_broker.key("client"))
        result = client.generate("echo", text="straight to storage", timeout=60)
    finally:
        stop_all()
    out = result.outputs[0]
    assert result.urls[0] and result.urls[0].startswith(s3_broker.settings.s3_endpoint)
    assert out["download_expires_at"] > 0
    data = result.output_bytes(0)
    assert hashlib.sha256(data).hexdigest() == out["sha256"]
    assert b"straight to storage" in data
    # Stored in the bucket with its SHA-256 checksum; nothing in the broker's folder.
    blobs = s3_broker.services.jobs.blobs
    assert blobs.check(out["sha256"]) == "ok"
    assert _local_blobs(s3_broker) == []
    # The presigned URL needs no API key; the broker's own URL redirects there.
    assert httpx.get(result.urls[0]).content == data
    r = httpx.get(s3_broker.url + out["url"], headers={"Authorization": f"Bearer {client.api_key}"})
    assert r.status_code == 307 and r.headers["location"].startswith(s3_broker.settings.s3_endpoint)


def _raw_job(broker, client: Client | None = None):
    """A raw agent holding a fresh echo job of ``client``'s: (raw, key, job, envelope,
    envelope bytes)."""
    key = KeyPair.generate()
    raw = RawAgent(broker.grpc, broker.key("provider"))
    welcome = _handshake(raw, key).welcome
    assert welcome.direct_uploads
    client = client or Client(broker.url, broker.key("client"))
    job = client.jobs.create("echo", text="x")
    while True:
        msg = raw.recv()
        if msg.WhichOneof("body") == "assignment":
            break
    env = json.loads(msg.assignment.envelope)
    assert env["job_id"] == job.id
    return raw, key, job, env, msg.assignment.envelope


def _next(raw, kind):
    while True:
        msg = raw.recv()
        if msg.WhichOneof("body") == kind:
            return getattr(msg, kind)


def _receipt(raw, key, env, env_bytes, data, media_type="text/plain"):
    rec = make_receipt(envelope=env, envelope_bytes=env_bytes, provider_key=key.public_key_hex,
                       outputs=[{"index": 0, "sha256": hashlib.sha256(data).hexdigest(),
                                 "media_type": media_type, "size": len(data)}],
                       work_units=1.0, timings_ms={"run": 1})
    body = canonical_bytes(rec)
    raw.send(receipt=pb.Receipt(receipt=body, signature=key.sign_canonical("receipt", body)))


def test_a_tampered_object_is_refused_and_an_honest_upload_then_settles(s3_broker):
    raw, key, job, env, env_bytes = _raw_job(s3_broker)
    try:
        data = b"the honest output"
        sha = hashlib.sha256(data).hexdigest()
        raw.send(upload_request=pb.UploadRequest(job_id=job.id, attempt=env["attempt"],
                                                 request_id="r1", blobs=[pb.BlobToUpload(
                                                     sha256=sha, size=len(data), kind="output")]))
        grant = _next(raw, "upload_grant")
        assert grant.request_id == "r1" and not grant.error
        put = grant.uploads[0]
        # A PUT of other bytes through the pinned URL is refused by the store.
        r = httpx.put(put.url, content=b"forged bytes here", headers=dict(put.headers))
        assert r.status_code == 400
        # A receipt before any upload: refused, the job stays the agent's.
        _receipt(raw, key, env, env_bytes, data)
        assert _next(raw, "refusal").code == "output_missing"
        # Uploaded, then replaced in the bucket behind the broker's back: refused.
        assert httpx.put(put.url, content=data, headers=dict(put.headers)).status_code == 200
        blobs = s3_broker.services.jobs.blobs
        blobs.s3.put_object(Bucket=blobs.bucket, Key=sha, Body=b"tampered",
                            ChecksumAlgorithm="SHA256")
        _receipt(raw, key, env, env_bytes, data)
        refusal = _next(raw, "refusal")
        assert refusal.code == "output_checksum_mismatch", refusal
        assert "checksum" in refusal.message
        assert s3_broker.services.jobs.repo.get(job.id).state.value in ("matched", "running")
        # The honest bytes again: the receipt settles.
        assert httpx.put(put.url, content=data, headers=dict(put.headers)).status_code == 200
        _receipt(raw, key, env, env_bytes, data)
        assert _next(raw, "ack").what == "receipt"
        assert s3_broker.services.jobs.repo.get(job.id).state.value == "settled"
    finally:
        raw.close()


def test_upload_urls_only_for_the_jobs_an_agent_holds(s3_broker):
    raw, key, job, env, _ = _raw_job(s3_broker)
    other = RawAgent(s3_broker.grpc, s3_broker.key("provider"))
    try:
        _handshake(other, KeyPair.generate())
        other.send(upload_request=pb.UploadRequest(
            job_id=job.id, attempt=env["attempt"], request_id="r2",
            blobs=[pb.BlobToUpload(sha256="a" * 64, size=3, kind="output")]))
        grant = _next(other, "upload_grant")
        assert grant.code == "not_your_job" and not grant.uploads
        raw.send(upload_request=pb.UploadRequest(
            job_id=job.id, attempt=env["attempt"], request_id="r3",
            blobs=[pb.BlobToUpload(sha256="not-a-sha", size=3, kind="output")]))
        grant = _next(raw, "upload_grant")
        assert grant.code == "invalid_request" and "sha256" in grant.error
    finally:
        other.close()
        raw.close()


def test_a_download_url_never_serves_a_providers_html_as_html(s3_broker):
    client = Client(s3_broker.url, s3_broker.key("client"))
    raw, key, job, env, env_bytes = _raw_job(s3_broker, client)
    try:
        data = b"<script>alert(1)</script>"
        sha = hashlib.sha256(data).hexdigest()
        raw.send(upload_request=pb.UploadRequest(job_id=job.id, attempt=env["attempt"],
                                                 request_id="h", blobs=[pb.BlobToUpload(
                                                     sha256=sha, size=len(data))]))
        put = _next(raw, "upload_grant").uploads[0]
        assert httpx.put(put.url, content=data, headers=dict(put.headers)).status_code == 200
        _receipt(raw, key, env, env_bytes, data, media_type="text/html")
        assert _next(raw, "ack").what == "receipt"
    finally:
        raw.close()
    r = httpx.get(client.jobs.get(job.id).data["outputs"][0]["download_url"])
    assert r.content == data
    assert r.headers["content-type"] == "application/octet-stream"
    assert r.headers["content-disposition"] == "attachment"
