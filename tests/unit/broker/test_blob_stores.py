"""The blob-store contract, run on the local folder and on a real S3 API (moto's server in its
own process, tests/s3_server.py): what the job service, checkpoints, verification and the
retention sweep rely on, whichever store the broker runs with."""
from __future__ import annotations

import hashlib
import time

import httpx
import pytest

from broker.blobs.errors import BlobCorrupt
from broker.blobs.local import LocalBlobStore
from broker.errors import NotFound
from tests.conftest import make_s3_store


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalBlobStore(tmp_path / "blobs")
    return make_s3_store(request.getfixturevalue("s3_endpoint"))


def test_put_returns_the_sha256_and_get_gives_the_bytes_back(store):
    data = b"an output" * 1000
    key = store.put(data)
    assert key == hashlib.sha256(data).hexdigest()
    assert store.get(key) == data
    assert store.size(key) == len(data)
    assert store.exists(key) and store.check(key) == "ok"


def test_putting_the_same_bytes_twice_is_one_blob(store):
    a = store.put(b"same")
    assert store.put(b"same") == a
    assert [b.key for b in store.blobs()] == [a]


def test_an_absent_blob_is_not_found_and_not_there(store):
    key = hashlib.sha256(b"never stored").hexdigest()
    assert not store.exists(key)
    assert store.check(key) == "missing"
    with pytest.raises(NotFound):
        store.get(key)
    with pytest.raises(NotFound):
        store.size(key)


@pytest.mark.parametrize("bad", ["../../etc/passwd", "A" * 64, "abc", ""])
def test_a_key_that_is_no_sha256_is_refused_not_resolved(store, bad):
    assert not store.exists(bad)
    with pytest.raises(NotFound, match="sha256 hex"):
        store.get(bad)


def test_delete_removes_a_blob_and_usage_counts_what_is_left(store):
    a, b = store.put(b"x" * 100), store.put(b"y" * 50)
    assert store.usage() == (2, 150)
    store.delete(a)
    assert not store.exists(a) and store.exists(b)
    assert store.usage() == (1, 50)
    assert {s.key: s.size for s in store.blobs()} == {b: 50}
    assert all(abs(s.modified_at - time.time()) < 120 for s in store.blobs())
    store.delete(a)  # deleting what is gone is no error
    assert store.usage() == (1, 50)


def test_only_the_object_store_presigns(store):
    assert store.presigns is (not isinstance(store, LocalBlobStore))


# ---- what only S3 does ----------------------------------------------------------------------
def test_a_presigned_put_stores_exactly_the_pinned_bytes(s3_store):
    data = b"\x89PNG" + b"pixels" * 5000
    key = hashlib.sha256(data).hexdigest()
    put = s3_store.presign_put(key, len(data))
    assert "x-amz-checksum-sha256" in put.url.lower()  # a signed header: it must be sent
    r = httpx.put(put.url, content=data, headers=put.headers)
    assert r.status_code == 200, r.text
    assert s3_store.check(key) == "ok" and s3_store.get(key) == data


def test_a_presigned_put_of_other_bytes_is_refused_and_stores_nothing(s3_store):
    key = hashlib.sha256(b"the real output").hexdigest()
    put = s3_store.presign_put(key, len(b"a forged output"))
    r = httpx.put(put.url, content=b"a forged output", headers=put.headers)
    assert r.status_code == 400 and "BadDigest" in r.text
    assert s3_store.check(key) == "missing"


def test_a_presigned_put_without_its_checksum_header_is_refused(s3_store):
    data = b"some output"
    key = hashlib.sha256(data).hexdigest()
    put = s3_store.presign_put(key, len(data))
    r = httpx.put(put.url, content=data)  # the signed checksum headers left out
    assert r.status_code == 403
    assert s3_store.check(key) == "missing"


def test_an_object_changed_in_the_bucket_fails_its_check(s3_store):
    data = b"honest output"
    key = s3_store.put(data)
    # Someone with bucket access replaces the object: with no checksum, then with the
    # checksum of its new bytes. Neither passes as the blob its key names.
    s3_store.s3.put_object(Bucket=s3_store.bucket, Key=key, Body=b"tampered")
    assert s3_store.check(key) == "no_checksum" and not s3_store.exists(key)
    s3_store.s3.put_object(Bucket=s3_store.bucket, Key=key, Body=b"tampered",
                           ChecksumAlgorithm="SHA256")
    assert s3_store.check(key) == "mismatch"
    with pytest.raises(BlobCorrupt, match="other bytes"):
        s3_store.get(key)


def test_presigned_gets_work_until_they_expire(s3_endpoint):
    clock = [time.time()]
    store = make_s3_store(s3_endpoint, get_ttl_s=60, clock=lambda: clock[0])
    key = store.put(b"an image")
    url, expires_at = store.presign_get(key, media_type="image/png")
    assert expires_at == pytest.approx(clock[0] + 60)
    r = httpx.get(url)
    assert r.status_code == 200 and r.content == b"an image"
    assert r.headers["content-type"] == "image/png"
    short, _ = store.presign_get(key, ttl_s=1)
    time.sleep(2.1)
    r = httpx.get(short)
    assert r.status_code == 403 and "expired" in r.text


def test_a_missing_bucket_says_what_to_do(s3_endpoint):
    from broker.blobs.errors import BlobStoreUnavailable
    from broker.blobs.s3 import S3BlobStore
    from tests.conftest import S3_TEST_KEYS

    store = S3BlobStore("sc-no-such-bucket", endpoint_url=s3_endpoint, region="us-east-1",
                        path_style=True, **S3_TEST_KEYS)
    with pytest.raises(BlobStoreUnavailable, match="does not exist"):
        store.put(b"x")


def test_each_store_has_every_method_the_job_service_port_declares(store):
    # broker.jobs.ports.BlobStore is the port the job service types its store with; a merge
    # once left half its methods under NoMetrics, so the port must list what the stores keep
    import inspect

    from broker.jobs import ports

    declared = {n for n, v in vars(ports.BlobStore).items()
                if inspect.isfunction(v) and not n.startswith("_")}
    assert {"put", "get", "exists", "check", "delete", "usage",
            "presign_put", "presign_get"} <= declared
    for name in declared:
        if name.startswith("presign_") and not store.presigns:
            continue  # the port's presigns flag: only a presigning store has these
        assert callable(getattr(store, name, None)), name
    metrics = {n for n, v in vars(ports.NoMetrics).items()
               if inspect.isfunction(v) and not n.startswith("_")}
    assert metrics == {n for n, v in vars(ports.JobMetrics).items()
                       if inspect.isfunction(v) and not n.startswith("_")}
