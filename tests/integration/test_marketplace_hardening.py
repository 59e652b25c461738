"""Regressions from the marketplace review, through a real broker (uvicorn): blob uploads
are checked before the body is read and capped (413), streamed to a registry store of its
own (job outputs cannot be listed in a package), downloads are streamed, and malformed
signatures, NaN documents and over-long versions are 4xx, never 500."""
import hashlib
import json

import httpx
import pytest

from sdk.client import Client
from sdk.protocol.package import build_document, sign_document
from sdk.protocol.signing import KeyPair

from tests.integration.conftest import LiveBroker
from tests.marketplace_helpers import adapter_folder, plugin_folder


@pytest.fixture
def market(tmp_path):
    broker = LiveBroker(tmp_path)
    yield broker
    broker.stop()


def _http(market, key: str) -> httpx.Client:
    return httpx.Client(base_url=market.url, headers={"Authorization": f"Bearer {key}"},
                        timeout=30)


def _publisher(market):
    key, keys = market.key("publisher"), KeyPair.generate()
    with Client(market.url, key) as c:
        c.register_publisher_key(keys)
    return key, keys


def test_blob_uploads_are_checked_first_capped_and_kept_apart(market, tmp_path):
    registry = market.services.registry
    data = b"weights " * 512
    sha = hashlib.sha256(data).hexdigest()
    with _http(market, market.key("client")) as client:
        r = client.put(f"/v1/blobs/{sha}", content=data)
        assert r.status_code == 403 and r.json()["code"] == "not_a_publisher"
    with _http(market, market.key("publisher")) as keyless:
        r = keyless.put(f"/v1/blobs/{sha}", content=data)
        assert r.status_code == 403 and r.json()["code"] == "no_publisher_key"
    pub_key, keys = _publisher(market)
    with _http(market, pub_key) as pub:
        r = pub.put("/v1/blobs/not-a-sha", content=data)
        assert r.status_code == 400 and r.json()["field"] == "sha256"
        registry.max_blob_bytes = len(data) - 1
        r = pub.put(f"/v1/blobs/{sha}", content=data)                 # declared length
        assert r.status_code == 413 and r.json()["code"] == "payload_too_large"
        r = pub.put(f"/v1/blobs/{sha}", content=iter([data[:1000], data[1000:]]))  # chunked
        assert r.status_code == 413 and r.json()["code"] == "payload_too_large"
        assert not registry.blobs.exists(sha)
        registry.max_blob_bytes = len(data)
        r = pub.put(f"/v1/blobs/{sha}", content=iter([data[:1000], data[1000:]]))
        assert r.status_code == 201 and r.json() == {"object": "blob", "sha256": sha,
                                                      "size": len(data), "created": True}
        assert pub.put(f"/v1/blobs/{sha}", content=data).status_code == 200
        bad = pub.put(f"/v1/blobs/{'0' * 64}", content=data)
        assert bad.status_code == 422 and bad.json()["code"] == "sha256_mismatch"
    assert registry.blobs.root == market.settings.blob_dir / "registry"
    assert registry.blobs.get(sha) == data and not market.services.jobs.blobs.exists(sha)
    assert list(registry.blobs.tmp_dir().iterdir()) == []


def test_a_job_output_cannot_be_listed_in_a_package(market, tmp_path):
    pub_key, keys = _publisher(market)
    folder = adapter_folder(tmp_path, name="leak")
    doc = build_document(folder, keys.public_key_hex)
    weights = next(f for f in doc["files"] if f["path"].endswith(".safetensors"))
    # the bytes are a job output (the job store) that the publisher never uploaded
    market.services.jobs.blobs.put((folder / weights["path"]).read_bytes())
    with _http(market, pub_key) as pub:
        for f in doc["files"]:
            if f is not weights:
                pub.put(f"/v1/blobs/{f['sha256']}", content=(folder / f["path"]).read_bytes())
        r = pub.post("/v1/adapters", json={"document": doc,
                                           "signature": sign_document(keys, doc)})
        assert r.status_code == 409 and r.json()["code"] == "missing_file"
        assert weights["sha256"][:16] in r.json()["detail"]


def test_downloads_are_streamed_with_their_headers(market, tmp_path):
    pub_key, keys = _publisher(market)
    folder = adapter_folder(tmp_path, name="ink", payload=b"\x01" * 70_000)
    with Client(market.url, pub_key) as c:
        c.publish(folder, keys)
    with _http(market, market.key("client")) as client:
        r = client.get("/v1/adapters/ink/1.0.0/files/pytorch_lora_weights.safetensors")
        assert r.status_code == 200 and r.content == b"\x01" * 70_000
        assert r.headers["Content-Type"] == "application/octet-stream"
        assert r.headers["X-Content-SHA256"] == hashlib.sha256(r.content).hexdigest()
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        assert r.headers["Cache-Control"] == "public, max-age=31536000, immutable"
        part = client.get("/v1/adapters/ink/1.0.0/files/pytorch_lora_weights.safetensors",
                          headers={"Range": "bytes=0-9"})
        assert part.status_code == 206 and part.content == b"\x01" * 10
        assert client.get("/v1/adapters/ink/1.0.0/files/nope").status_code == 404


def test_malformed_signatures_nan_and_long_versions_are_4xx(market, tmp_path):
    pub_key, keys = _publisher(market)
    adapter = build_document(adapter_folder(tmp_path), keys.public_key_hex)
    plugin = build_document(plugin_folder(tmp_path), keys.public_key_hex)
    with _http(market, pub_key) as pub:
        for path, doc in (("/v1/adapters", adapter), ("/v1/plugins", plugin)):
            r = pub.post(path, json={"document": doc, "signature": "abcd"})
            assert r.status_code == 400 and r.json()["code"] == "bad_signature", r.text
        fresh = KeyPair.generate()
        r = pub.post("/v1/publishers", json={"public_key": fresh.public_key_hex,
                                             "proof": "abcd"})
        assert r.status_code == 400 and r.json()["code"] == "bad_signature"
        nan = json.dumps({"document": plugin, "signature": sign_document(keys, plugin)})
        nan = nan.replace('"benchmark": {', '"benchmark": {"x": NaN, ', 1)
        r = pub.post("/v1/plugins", content=nan, headers={"Content-Type": "application/json"})
        # refused as it arrives: NaN is not JSON (no body the broker reads may hold it)
        assert r.status_code == 400 and r.json()["code"] == "malformed_json", r.text
        assert "NaN" in r.json()["detail"]
        long = {**adapter, "version": "1.0.0-" + "a" * 59}
        r = pub.post("/v1/adapters", json={"document": long,
                                           "signature": sign_document(keys, long)})
        assert r.status_code == 422 and r.json()["field"] == "version"
        assert "at most 64" in r.json()["detail"]
