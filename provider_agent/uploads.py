"""Direct uploads: outputs and checkpoints PUT straight into the broker's blob store (S3).

When the broker's Welcome says ``direct_uploads``, a finished job's outputs do not travel on
the gRPC stream: the agent asks for one presigned PUT URL per blob (UploadRequest), the
broker answers with URLs that store only the bytes of each blob's SHA-256 (UploadGrant),
the agent PUTs them, and then sends the receipt, which names the blobs by hash. The broker
checks each stored object's checksum before it settles.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import Callable

import httpx

from sdk.protocol import agent_pb2 as pb
from sdk.protocol.canonical import sha256_hex

from .errors import HostError

log = logging.getLogger("agent")
PUT_ATTEMPTS = 3


class DirectUploads:
    """Asks for presigned URLs over the stream (``send``) and PUTs blobs to them."""

    def __init__(self, send: Callable[[pb.AgentMessage], bool], *, grant_timeout_s: float = 60.0,
                 put_timeout_s: float = 120.0):
        self._send = send
        self.grant_timeout_s = grant_timeout_s
        self._http = httpx.Client(timeout=put_timeout_s)
        self._waiters: dict[str, queue.SimpleQueue] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        self._http.close()

    def granted(self, grant: pb.UploadGrant) -> None:
        """The broker's answer to one of our requests (from the stream's reader)."""
        with self._lock:
            waiter = self._waiters.get(grant.request_id)
        if waiter is not None:
            waiter.put(grant)

    def upload(self, job_id: str, attempt: int, blobs: list[tuple[bytes, str]]) -> None:
        """PUT each (data, kind) to the blob store; raises HostError (retryable) when that
        cannot be done, so the job goes back to the broker instead of a receipt it would
        refuse."""
        if not blobs:
            return
        shas = [sha256_hex(data) for data, _ in blobs]
        grant = self._grant(job_id, attempt, [
            pb.BlobToUpload(sha256=sha, size=len(data), kind=kind)
            for sha, (data, kind) in zip(shas, blobs)])
        urls = {u.sha256: u for u in grant.uploads}
        for sha, (data, _) in zip(shas, blobs):
            u = urls.get(sha)
            if u is None:
                raise HostError("upload_failed", f"the broker gave no upload URL for "
                                f"{sha[:12]}…", retryable=True)
            self._put(job_id, u, data)

    def _grant(self, job_id: str, attempt: int, blobs: list) -> pb.UploadGrant:
        request_id = uuid.uuid4().hex
        waiter: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._waiters[request_id] = waiter
        try:
            deadline = time.monotonic() + self.grant_timeout_s
            while time.monotonic() < deadline:
                self._send(pb.AgentMessage(upload_request=pb.UploadRequest(
                    job_id=job_id, attempt=attempt, request_id=request_id, blobs=blobs)))
                try:
                    grant = waiter.get(timeout=min(5.0, max(0.1, deadline - time.monotonic())))
                except queue.Empty:
                    continue  # lost on a reconnect: ask again
                if grant.error:
                    raise HostError("upload_refused", f"the broker refused upload URLs for job "
                                    f"{job_id}: {grant.error} ({grant.code})",
                                    retryable=grant.code != "not_your_job")
                return grant
            raise HostError("upload_failed", f"no upload URLs for job {job_id} within "
                            f"{self.grant_timeout_s:g} s", retryable=True)
        finally:
            with self._lock:
                self._waiters.pop(request_id, None)

    def _put(self, job_id: str, u: pb.UploadUrl, data: bytes) -> None:
        why = ""
        for attempt in range(PUT_ATTEMPTS):
            try:
                r = self._http.put(u.url, content=data, headers=dict(u.headers))
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"
            else:
                if r.status_code < 300:
                    return
                why = f"HTTP {r.status_code}: {r.text[:300]}"
                if r.status_code < 500 and r.status_code != 429:
                    break  # refused (expired, bad digest): asking again will not help
            time.sleep(0.2 * 2 ** attempt)
        raise HostError("upload_failed", f"uploading output {u.sha256[:12]}… of job {job_id} "
                        f"to the blob store failed: {why}", retryable=True)

    def fetch(self, url: str, sha256: str) -> bytes | None:
        """GET a blob by presigned URL; None unless its bytes have ``sha256``."""
        try:
            r = self._http.get(url)
        except httpx.HTTPError as exc:
            log.warning("fetching %s… from the blob store failed: %s", sha256[:12], exc)
            return None
        if r.status_code != 200 or sha256_hex(r.content) != sha256:
            log.warning("fetching %s… from the blob store: HTTP %d%s", sha256[:12],
                        r.status_code, ", hash mismatch" if r.status_code == 200 else "")
            return None
        return r.content
