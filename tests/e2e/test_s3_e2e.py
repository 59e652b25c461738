"""The spine on S3 (issue #24), end to end: real broker and agent processes on loopback and a
real S3 API in a third process (moto's server, tests/s3_server.py). Agents PUT outputs and
checkpoints with presigned URLs, a job killed mid-run resumes elsewhere from the checkpoint
it GETs from the bucket, the client downloads with presigned GETs that expire, a tampered
object is refused, and the broker's own retention sweep deletes the spent checkpoints."""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import time
import uuid

import httpx
import pytest

from sdk import Client
from sdk.localnet import LocalNetwork
from broker.blobs.s3 import S3BlobStore
from tests.conftest import S3_TEST_KEYS

SANDBOX = shutil.which("bwrap") is not None
pytestmark = [pytest.mark.e2e]
GET_TTL_S = 3
INPUTS = dict(prompt="a lighthouse at dusk", seed=7, steps=12, width=64, height=64)


@pytest.fixture
def s3net(tmp_path, s3_endpoint, request):
    bucket = f"sc-e2e-{uuid.uuid4().hex[:12]}"
    env = {"SPARECYCLES_VERIFICATION": "off", "SPARECYCLES_BLOB_STORE": "s3",
           "SPARECYCLES_S3_BUCKET": bucket, "SPARECYCLES_S3_ENDPOINT": s3_endpoint,
           "SPARECYCLES_S3_REGION": "us-east-1", "SPARECYCLES_S3_PATH_STYLE": "on",
           "SPARECYCLES_S3_GET_TTL_S": str(GET_TTL_S),
           "SPARECYCLES_CHECKPOINT_EVERY_STEPS": "2",
           "SPARECYCLES_RETENTION_INTERVAL_S": "1", "SPARECYCLES_MAINTENANCE_INTERVAL_S": "0.5",
           "AWS_ACCESS_KEY_ID": S3_TEST_KEYS["access_key_id"],
           "AWS_SECRET_ACCESS_KEY": S3_TEST_KEYS["secret_access_key"]}
    net = LocalNetwork(tmp_path / "net", lease_timeout_s=3, env=env)
    net.bucket = bucket
    yield net
    net.stop()
    if getattr(getattr(request.node, "rep_call", None), "failed", False):
        for log in sorted(net.workdir.glob("*.log")):
            print(f"--- {log.name}\n{net.tail(log.name, 40)}")


def test_the_spine_on_s3(s3net, s3_endpoint, tiny_weights):
    from tests.integration.test_s3_outputs import _next, _receipt
    from tests.integration.test_gateway_and_sdk import RawAgent, _handshake
    from sdk.protocol import agent_pb2 as pb
    from sdk.protocol.signing import KeyPair
    import json

    net = s3net
    net.start_broker()
    store = S3BlobStore(net.bucket, endpoint_url=s3_endpoint, region="us-east-1",
                        path_style=True, **S3_TEST_KEYS)  # the broker's bucket, to look in
    keys = {n: net.create_key("provider", n) for n in ("alpha", "beta")}
    client = Client(net.url, net.create_key("client"))
    agents = {n: net.start_agent(n, k, plugins="sd15", weights_dir=tiny_weights,
                                 sandbox=SANDBOX) for n, k in keys.items()}
    net.wait_for_providers(2)

    # A job killed after its first checkpoint resumes on the other agent from the bucket.
    job = client.jobs.create("sd15", **INPUTS)
    deadline = time.monotonic() + 120
    for ev in job.events():
        assert time.monotonic() < deadline, "no checkpoint within 120 s"
        if ev.kind == "checkpoint":
            checkpoint = ev.data["sha256"]
            break
    assert store.check(checkpoint) == "ok"  # the agent PUT it there, the broker checked it
    victim = next(a for a in agents.values()
                  if job.refresh().data["provider_id"] in a.log_path.read_text())
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(10)
    result = job.wait(timeout=240)
    assert result.job.data["attempt"] == 1
    assert "resuming from the checkpoint" in next(
        a for a in agents.values() if a is not victim).log_path.read_text()

    # The output is in the bucket; the broker's folder holds no job blob.
    out = result.outputs[0]
    assert store.check(out["sha256"]) == "ok"
    local = net.data_dir / "blobs"
    assert not [p for p in local.rglob("*") if p.is_file() and "registry" not in p.parts]
    # The client downloads straight from storage, with a URL that expires.
    url = result.urls[0]
    assert url.startswith(s3_endpoint)
    png = httpx.get(url).content
    assert hashlib.sha256(png).hexdigest() == out["sha256"] and png[:4] == b"\x89PNG"
    time.sleep(GET_TTL_S + 1.5)
    assert httpx.get(url).status_code == 403  # expired
    assert result.output_bytes(0) == png  # the SDK asks for a fresh URL and gets the bytes

    # The broker's own sweep deletes the spent checkpoints once the job is over.
    deadline = time.monotonic() + 20
    while store.check(checkpoint) != "missing":
        assert time.monotonic() < deadline, "the spent checkpoint was not swept"
        time.sleep(0.3)
    assert store.check(out["sha256"]) == "ok"  # outputs stay for their retention time

    # A raw agent's object tampered with in the bucket is refused at the receipt.
    key = KeyPair.generate()
    raw = RawAgent(net.info["grpc"], net.create_key("provider", "raw"))
    try:
        assert _handshake(raw, key).welcome.direct_uploads
        echo = client.jobs.create("echo", text="x")
        assignment = _next(raw, "assignment")
        env = json.loads(assignment.envelope)
        assert env["job_id"] == echo.id
        data = b"honest bytes"
        sha = hashlib.sha256(data).hexdigest()
        raw.send(upload_request=pb.UploadRequest(job_id=echo.id, attempt=env["attempt"],
                                                 request_id="t", blobs=[pb.BlobToUpload(
                                                     sha256=sha, size=len(data))]))
        put = _next(raw, "upload_grant").uploads[0]
        assert httpx.put(put.url, content=data, headers=dict(put.headers)).status_code == 200
        store.s3.put_object(Bucket=net.bucket, Key=sha, Body=b"tampered")
        _receipt(raw, key, env, assignment.envelope, data)
        assert _next(raw, "refusal").code == "output_checksum_mismatch"
    finally:
        raw.close()
    client.close()
