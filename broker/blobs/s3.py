"""S3BlobStore: content-addressed objects in an S3-compatible bucket, through boto3.

The same contract as :class:`broker.blobs.local.LocalBlobStore` (a blob's key is its sha256
hex), plus what only an object store can do: hand out **presigned URLs**. Agents PUT their
outputs and checkpoints straight into the bucket with a URL that pins the object's SHA-256
(``x-amz-checksum-sha256`` and ``x-amz-sdk-checksum-algorithm`` are signed headers: a PUT
without them, or with another digest, is refused, and the store checks the body against the
digest), and clients GET outputs with short-lived URLs, so no output byte passes through the
broker. Before the broker settles a receipt it asks the store (a HEAD with the checksum
mode on) for each object's SHA-256: an object that is missing, has no SHA-256 checksum, or
whose checksum is not its key is refused (:meth:`check`).

Credentials come from boto3's usual chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, an instance role). Self-hosted stores (MinIO, Ceph,
moto's server) want path-style addressing (``http://host:9000/bucket/key``).
"""
from __future__ import annotations

import base64
import hashlib
import logging
import time
from typing import Iterator

from sdk.protocol.canonical import is_sha256_hex

from broker.errors import BrokerError, NotFound
from .errors import BlobCorrupt, BlobStoreUnavailable
from .model import PresignedPut, StoredBlob

log = logging.getLogger(__name__)


def sha256_b64(key: str) -> str:
    """The base64 form of a sha256 hex digest, as S3's checksum headers carry it."""
    return base64.b64encode(bytes.fromhex(key)).decode("ascii")


class S3BlobStore:
    """Blobs in ``bucket`` under ``prefix`` (``<prefix><sha256 hex>``)."""

    presigns = True

    def __init__(self, bucket: str, *, endpoint_url: str | None = None,
                 region: str | None = None, path_style: bool = False, prefix: str = "",
                 get_ttl_s: float = 300.0, put_ttl_s: float = 900.0,
                 access_key_id: str | None = None, secret_access_key: str | None = None,
                 session_token: str | None = None, clock=time.time):
        if not bucket:
            raise ValueError("an S3 blob store needs a bucket (SPARECYCLES_S3_BUCKET)")
        if get_ttl_s <= 0 or put_ttl_s <= 0:
            raise ValueError(f"presigned URL lifetimes must be > 0 s, got GET {get_ttl_s}, "
                             f"PUT {put_ttl_s}")
        self.bucket = bucket
        self.prefix = prefix
        self.get_ttl_s = float(get_ttl_s)
        self.put_ttl_s = float(put_ttl_s)
        self.endpoint_url = endpoint_url
        self.clock = clock
        import boto3
        from botocore.config import Config

        # Keys given here (the settings' AWS_* variables) beat the rest of boto3's chain
        # (profiles, an instance role).
        self.s3 = boto3.session.Session(
            aws_access_key_id=access_key_id, aws_secret_access_key=secret_access_key,
            aws_session_token=session_token).client("s3", endpoint_url=endpoint_url or None, region_name=region or None,
                config=Config(
                    signature_version="s3v4",
                    s3={"addressing_style": "path" if path_style else "auto"},
                    # Checksums are ours to choose (SHA-256, pinned per object), not the
                    # SDK's default CRC32 on every request.
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                    retries={"max_attempts": 4, "mode": "standard"},
                    max_pool_connections=64))
        import urllib3

        self._http = urllib3.PoolManager(maxsize=16, timeout=urllib3.Timeout(connect=10,
                                                                            read=30))

    def __repr__(self) -> str:
        where = self.endpoint_url or "AWS"
        return f"S3BlobStore(s3://{self.bucket}/{self.prefix} at {where})"

    # ---- helpers ---------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        if not is_sha256_hex(key):
            raise NotFound(f"no blob {key!r}: blob keys are sha256 hex digests")
        return self.prefix + key

    def _call(self, what: str, fn, **kwargs):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.bucket, **kwargs)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchKey", "NotFound"):
                raise NotFound(f"no blob {kwargs.get('Key', '')[len(self.prefix):]}") from None
            if code in ("NoSuchBucket",):
                raise BlobStoreUnavailable(
                    f"the S3 bucket {self.bucket!r} does not exist at "
                    f"{self.endpoint_url or 'AWS'}; create it (the broker creates it at start "
                    "when its credentials may) and check SPARECYCLES_S3_BUCKET") from None
            raise BlobStoreUnavailable(f"S3 {what} on s3://{self.bucket} failed: {code} "
                                       f"{exc.response.get('Error', {}).get('Message', '')}; "
                                       "check the bucket, the credentials (AWS_ACCESS_KEY_ID/"
                                       "AWS_SECRET_ACCESS_KEY) and SPARECYCLES_S3_ENDPOINT") from None
        except BotoCoreError as exc:
            raise BlobStoreUnavailable(f"S3 {what} on s3://{self.bucket} failed: {exc}; is "
                                       f"{self.endpoint_url or 'AWS'} reachable?") from None

    def ensure_bucket(self) -> bool:
        """Create the bucket when it does not exist; True when it was created."""
        from botocore.exceptions import ClientError

        try:
            self.s3.head_bucket(Bucket=self.bucket)
            return False
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code")) not in ("404", "NoSuchBucket",
                                                                         "NotFound"):
                raise BlobStoreUnavailable(f"cannot reach bucket {self.bucket!r}: {exc}") from None
        region = self.s3.meta.region_name
        kwargs = {}
        if region and region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        self._call("CreateBucket", self.s3.create_bucket, **kwargs)
        log.info("created S3 bucket %s", self.bucket)
        return True

    # ---- the blob-store contract -----------------------------------------------------------
    def put(self, data: bytes) -> str:
        key = hashlib.sha256(data).hexdigest()
        self._call("PutObject", self.s3.put_object, Key=self._key(key), Body=data,
                   ChecksumAlgorithm="SHA256", ChecksumSHA256=sha256_b64(key))
        return key

    def get(self, key: str) -> bytes:
        body = self._call("GetObject", self.s3.get_object, Key=self._key(key))["Body"].read()
        if hashlib.sha256(body).hexdigest() != key:
            raise BlobCorrupt(f"blob {key} in s3://{self.bucket} holds other bytes (its "
                              "sha256 is not its key): the object was changed in the bucket")
        return body

    def size(self, key: str) -> int:
        return int(self._call("HeadObject", self.s3.head_object,
                              Key=self._key(key))["ContentLength"])

    def exists(self, key: str) -> bool:
        """Whether blob ``key`` is stored with its own sha256 (see :meth:`check`)."""
        try:
            return self.check(key) == "ok"
        except NotFound:
            return False

    def check(self, key: str) -> str:
        """What the store says of object ``key``: "ok" (its SHA-256 checksum is its key),
        "missing", "no_checksum" (stored without a SHA-256 checksum: not through a URL of
        ours) or "mismatch" (another object's bytes). Costs one HEAD, no bytes: a HEAD
        presigned here and sent with urllib3, because botocore's request pipeline spends
        about 1.5 ms of CPU per call and the broker checks every output of every job."""
        import urllib3

        url = self.s3.generate_presigned_url(
            "head_object", Params={"Bucket": self.bucket, "Key": self._key(key),
                                   "ChecksumMode": "ENABLED"}, ExpiresIn=60)
        try:
            r = self._http.request("HEAD", url, headers={"x-amz-checksum-mode": "ENABLED"},
                                   retries=urllib3.Retry(3, backoff_factor=0.1,
                                                         status_forcelist=(500, 502, 503, 504)))
        except urllib3.exceptions.HTTPError as exc:
            raise BlobStoreUnavailable(f"S3 HeadObject on s3://{self.bucket} failed: {exc}; is "
                                       f"{self.endpoint_url or 'AWS'} reachable?") from None
        if r.status == 404:
            return "missing"
        if r.status != 200:
            raise BlobStoreUnavailable(f"S3 HeadObject on s3://{self.bucket} answered "
                                       f"{r.status}; check the bucket, the credentials and "
                                       "SPARECYCLES_S3_ENDPOINT")
        got = r.headers.get("x-amz-checksum-sha256")
        if not got:
            return "no_checksum"
        if "-" in got or got != sha256_b64(key):  # "-N": a multipart composite
            return "mismatch"
        return "ok"

    def delete(self, key: str) -> bool:
        self._call("DeleteObject", self.s3.delete_object, Key=self._key(key))
        return True

    def blobs(self) -> Iterator[StoredBlob]:
        """Every object under the prefix whose name is a blob key."""
        paginator = self.s3.get_paginator("list_objects_v2")
        try:
            pages = paginator.paginate(Bucket=self.bucket, Prefix=self.prefix)
            for page in pages:
                for obj in page.get("Contents", ()):
                    key = obj["Key"][len(self.prefix):]
                    if is_sha256_hex(key):
                        yield StoredBlob(key, int(obj["Size"]),
                                         obj["LastModified"].timestamp())
        except Exception as exc:  # noqa: BLE001 - botocore's errors, said plainly
            if isinstance(exc, BrokerError):
                raise
            raise BlobStoreUnavailable(f"listing s3://{self.bucket}/{self.prefix} failed: "
                                       f"{exc}") from None

    def usage(self) -> tuple[int, int]:
        """(blobs, bytes) stored."""
        n = total = 0
        for b in self.blobs():
            n += 1
            total += b.size
        return n, total

    # ---- presigned URLs --------------------------------------------------------------------
    def presign_put(self, key: str, size: int | None = None) -> PresignedPut:
        """A URL that stores exactly the bytes whose sha256 is ``key`` (and nothing else:
        the checksum headers are signed and the store checks the body against them)."""
        b64 = sha256_b64(self._key(key)[len(self.prefix):])
        params = {"Bucket": self.bucket, "Key": self._key(key), "ChecksumSHA256": b64,
                  "ChecksumAlgorithm": "SHA256"}
        headers = {"x-amz-checksum-sha256": b64, "x-amz-sdk-checksum-algorithm": "SHA256"}
        if size is not None:
            params["ContentLength"] = int(size)
            headers["content-length"] = str(int(size))
        url = self.s3.generate_presigned_url("put_object", Params=params,
                                             ExpiresIn=int(self.put_ttl_s))
        return PresignedPut(url, headers, self.clock() + self.put_ttl_s)

    def presign_get(self, key: str, ttl_s: float | None = None,
                    media_type: str | None = None,
                    attachment: bool = False) -> tuple[str, float]:
        """A URL anyone holding it may GET blob ``key`` with, for ``ttl_s`` (default
        ``get_ttl_s``), answered with ``media_type`` (and as an attachment); returns
        (url, expires at)."""
        ttl = int(ttl_s or self.get_ttl_s)
        params = {"Bucket": self.bucket, "Key": self._key(key)}
        if media_type:
            params["ResponseContentType"] = media_type
        if attachment:
            params["ResponseContentDisposition"] = "attachment"
        url = self.s3.generate_presigned_url("get_object", Params=params, ExpiresIn=ttl)
        return url, self.clock() + ttl
