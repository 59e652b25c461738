"""A job while a provider holds it: the assignment (the lease and its signed envelope),
acceptance, progress and previews, uploads, heartbeats, and every way a lease ends short of
a receipt (given back, expired, taken back, cancelled, past its deadline, unserved).

A part of :class:`broker.jobs.service.JobService`.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from fractions import Fraction
from typing import Any

from sdk.protocol.canonical import is_sha256_hex, sha256_hex
from sdk.protocol.envelope import make_envelope, sign_envelope
from sdk.logs import new_request_digest, request_digest

from broker.auth.service import Principal
from broker.errors import InvalidRequest
from .errors import JobNotCancellable, ReceiptRefused
from .model import LEASED, Job, JobState
from .lease_check import check_lease, is_uuid, leased_job
from .repro import ENVELOPE_FIELD as REPRO_FIELD, declared_class

log = logging.getLogger(__name__)

ASSIGNED_COPIES = 4096  # leases kept as assign() wrote them, for their receipts
MAX_UPLOADS_PER_REQUEST = 1024  # blobs one UploadRequest may name (a receipt's outputs)
MAX_UPLOAD_BYTES = 5 << 30      # one presigned PUT (S3's limit for a single PUT)
MAX_PREVIEW_BYTES = 16 * 1024   # a progress preview (a thumbnail)
PREVIEW_TYPES = ("image/webp", "image/jpeg", "image/png")
NO_PROVIDER = "no_provider"        # a failure code: no provider served the build for long


class JobLeases:
    """Leases (a part of JobService)."""

    def assign(self, job: Job, target: AssignmentTarget,
               price_micro_per_unit: int | None = None) -> Job | None:
        """Lease ``job`` to ``target`` and push it the signed envelope. None when someone
        else moved the job first. ``price_micro_per_unit`` is the auction's clearing price
        (what settlement charges); None leaves the reserve."""
        now = self.clock()
        attempt = job.attempt
        # Every envelope names the weights to run on: the job's pin, else the digest the
        # agent advertises for this plugin version (what a check of this run then pins).
        served = getattr(target, "plugins", {}) or {}
        extra = {"weights_digest": job.weights_digest
                 or served.get(f"{job.plugin}@{job.plugin_version}") or "",
                 # the class this run is judged by, as its machine declared it now
                 REPRO_FIELD: declared_class(target, job.plugin, job.plugin_version),
                 # Never the client's text (sdk.logs): its digest, or a random one of the
                 # same shape for a job no request named.
                 "request_id": (request_digest(job.request_id) if job.request_id
                                else new_request_digest())}
        if job.output_format:  # the agent encodes image outputs so (provider_agent/encode.py)
            extra["output_format"] = job.output_format
        if self.checkpoints is not None:
            extra.update(self.checkpoints.envelope_extra(job) or {})
        envelope = make_envelope(job_id=job.id, attempt=attempt, plugin=job.plugin,
                                 version=job.plugin_version, inputs=job.inputs,
                                 provider_key=target.public_key,
                                 lease_timeout_s=self.settings.lease_timeout_s,
                                 ttl_s=self.settings.envelope_ttl_s, now=now, extra=extra,
                                 sealed=True)  # only the assigned provider reads the inputs
        # Signed first, so the copy kept for the receipt holds the signed bytes' hash.
        data, signature = sign_envelope(self.signer, envelope)
        moved = self.repo.transition(
            job.id, [JobState.QUEUED], JobState.MATCHED, expect_attempt=attempt,
            event=("assigned", {"provider_id": target.provider_id, "attempt": attempt}),
            provider_id=target.provider_id, envelope=envelope, matched_at=now,
            lease_expires_at=now + self.settings.lease_timeout_s,
            price_micro_per_unit=price_micro_per_unit)
        if moved is None:
            return None
        self.metrics.placed(job.plugin, now - (job.updated_at or job.created_at or now))
        with self._assigned_lock:
            self._assigned[moved.id] = (moved, sha256_hex(data))
            self._assigned.move_to_end(moved.id)
            if len(self._assigned) > ASSIGNED_COPIES:
                self._assigned.popitem(last=False)
        target.send_assignment(data, signature)
        self.hub.notify(job.id)
        return moved

    # ---- agents ----------------------------------------------------------------------
    def _leased(self, provider_id: str, job_id: str, attempt: int, job: Job | None = None) -> Job:
        """The job if ``attempt`` of it is leased to ``provider_id`` (``job``: as just read)."""
        return leased_job(self.repo, provider_id, job_id, attempt, job)

    def accepted(self, provider_id: str, job_id: str, attempt: int) -> None:
        now = self.clock()
        moved = self.repo.transition(job_id, [JobState.MATCHED], JobState.RUNNING,
                                     expect_attempt=attempt, expect_provider=provider_id,
                                     event=("running", {"attempt": attempt}), started_at=now,
                                     lease_expires_at=now + self.settings.lease_timeout_s)
        if moved is not None:
            self.hub.notify(job_id)

    def progress(self, provider_id: str, job_id: str, attempt: int, step: int, total: int,
                 message: str = "", text: str = "") -> None:
        job = self._leased(provider_id, job_id, attempt)
        if total and not text and total == job.progress_total and step <= job.progress_step:
            return  # a re-sent or late report: progress only moves forward (idempotent)
        data: dict[str, Any] = {"step": step, "total": total}
        if message:
            data["message"] = message
        if text:
            data["text"] = text
        # A streamed token without a step count leaves the step count as it is.
        fields = {"progress_step": step, "progress_total": total} if total else {}
        self.repo.add_event(job.id, "token" if text and not total else "progress", data,
                            **fields)
        self.hub.notify(job.id)

    def preview(self, provider_id: str, job_id: str, attempt: int, step: int, total: int,
                data: bytes, media_type: str) -> None:
        """A small picture of the job's output so far: a "preview" event the client's
        event stream carries as a data: URL (previews are thumbnails: at most
        MAX_PREVIEW_BYTES, of an image type; others are refused)."""
        job = self._leased(provider_id, job_id, attempt)
        if len(data) > MAX_PREVIEW_BYTES or media_type not in PREVIEW_TYPES:
            raise InvalidRequest(f"a preview must be an image of type "
                                 f"{', '.join(PREVIEW_TYPES)} of at most {MAX_PREVIEW_BYTES} "
                                 f"bytes; got {media_type!r}, {len(data)} bytes")
        import base64

        self.repo.add_event(job.id, "preview", {
            "step": step, "total": total,
            "preview": f"data:{media_type};base64,{base64.b64encode(data).decode()}"})
        self.hub.notify(job.id)

    def store_output(self, provider_id: str, job_id: str, attempt: int, data: bytes,
                     sha256: str) -> str:
        """An output sent ahead of its receipt (a large one)."""
        # Only the lease is needed, not the whole row.
        check_lease(job_id, provider_id, attempt,
                    self.repo.lease_of(job_id) if is_uuid(job_id) else None)
        return self._put_output(job_id, data, sha256)

    def grant_uploads(self, provider_id: str, job_id: str, attempt: int,
                      blobs: list[tuple[str, int]]) -> list:
        """Presigned PUT URLs (broker.blobs.model.PresignedPut), one per (sha256, size) in
        ``blobs``, for the provider holding ``attempt`` of the job: each stores only the
        bytes with that sha256, straight into the blob store (S3), never through here."""
        with self._assigned_lock:  # the lease as assign() wrote it, when it is the asker's
            copy = self._assigned.get(job_id)
        if copy is None or copy[0].provider_id != provider_id or copy[0].attempt != attempt:
            # Not this process's fresh lease: read it. (A copy out of date only hands out
            # URLs; the receipt's conditional settlement still decides.)
            check_lease(job_id, provider_id, attempt,
                        self.repo.lease_of(job_id) if is_uuid(job_id) else None)
        return self.presign_uploads(blobs)

    def presign_uploads(self, blobs: list[tuple[str, int]]) -> list:
        """:meth:`grant_uploads` without the lease check (a canary has no job row)."""
        if not getattr(self.blobs, "presigns", False):
            raise InvalidRequest("this broker's blob store takes no direct uploads; send "
                                 "outputs and checkpoints on the stream",
                                 code_override="no_direct_uploads")
        if not 0 < len(blobs) <= MAX_UPLOADS_PER_REQUEST:
            raise InvalidRequest(f"an upload request names {len(blobs)} blobs; 1 to "
                                 f"{MAX_UPLOADS_PER_REQUEST} are allowed")
        out = []
        for sha, size in blobs:
            if not is_sha256_hex(sha):
                raise InvalidRequest(f"blob {sha!r} is no sha256: give 64 lowercase hex digits")
            if not 0 <= size <= MAX_UPLOAD_BYTES:
                raise InvalidRequest(f"blob {sha[:12]}… is {size} bytes; at most "
                                     f"{MAX_UPLOAD_BYTES} are allowed")
            out.append(self.blobs.presign_put(sha, size))
        return out

    def _check_stored(self, job_id: str, index: int, sha: str) -> None:
        """Refuse a receipt naming an output the store does not hold as those exact bytes
        (for S3, the object's stored SHA-256 checksum: a HEAD, no bytes read)."""
        state = self.blobs.check(sha)
        if state == "missing":
            raise ReceiptRefused("output_missing",
                                 f"output {index} ({sha[:12]}…) was not uploaded before the receipt")
        if state != "ok":
            raise ReceiptRefused(
                "output_checksum_mismatch",
                f"output {index} of job {job_id}: the object stored as {sha[:12]}… is not "
                f"those bytes ({'stored without a SHA-256 checksum' if state == 'no_checksum' else 'its SHA-256 checksum differs'}); "
                "upload it again with a URL from an UploadRequest")

    def _put_output(self, job_id: str, data: bytes, sha256: str) -> str:
        _check_output(job_id, data, sha256)
        return self.blobs.put(data)

    def heartbeat(self, provider_id: str, running_job_ids: list[str]) -> None:
        ids = [j for j in running_job_ids if is_uuid(j)]
        self.repo.extend_leases(provider_id, ids, self.clock() + self.settings.lease_timeout_s)

    def give_back(self, provider_id: str, job_id: str, attempt: int, reason: str) -> Job | None:
        try:
            job = self._leased(provider_id, job_id, attempt)
        except ReceiptRefused:
            return None
        self.job_events.released(provider_id, job_id)
        return self._requeue(job, "given_back", reason, count_attempt=False)

    def reap_expired(self) -> list[Job]:
        """Requeue (or fail) every job whose lease has expired."""
        moved = []
        for job in self.repo.expired_leases(self.clock()):
            result = self.take_back(job, "lease_expired",
                                    f"provider {job.provider_id} stopped heartbeating")
            if result is not None:
                moved.append(result)
        if self.stalls is not None:
            moved += self.stalls.reap(self)
        for job in self.repo.overdue(self.clock()):
            result = self.expire(job)
            if result is not None:
                moved.append(result)
        return moved

    def expire(self, job: Job, last: str = "") -> Job | None:
        """``job`` is past its deadline (``deadline_s`` after it was created): it fails
        ``deadline_exceeded``, the agent running it is told to stop, and the client gets
        its hold back except for the work checkpoints saved (each provider whose checkpoint
        the job holds is paid its share of it; steps reported but not checkpointed are not
        paid). None when it moved first (settled, cancelled)."""
        message = (f"the job's deadline of {job.deadline_s:g} s passed before it could be "
                   "finished; it was stopped and the hold released, except for the work "
                   "its checkpoints saved" + (f"; last: {last}" if last else ""))
        with self.repo.atomic():
            moved = self.repo.transition(
                job.id, [job.state], JobState.FAILED, expect_attempt=job.attempt,
                event=("failed", {"code": "deadline_exceeded", "message": message}),
                error_code="deadline_exceeded", error_message=message,
                finished_at=self.clock(), lease_expires_at=None)
            if moved is not None:
                parts = self.checkpoints.saved_parts(job) if self.checkpoints is not None else []
                if parts:
                    # As a cancel pays, with nothing counted past the checkpoints.
                    unreported = replace(job, progress_step=0, progress_total=0)
                    self._money("deadline", job, lambda: self.billing.cancel_shared(
                        unreported, parts, Fraction(1), message))
                else:
                    self._money("release", moved,
                                lambda: self.billing.failed(moved, f"deadline_exceeded: "
                                                            f"{message}"))
        if moved is None:
            return None
        log.info("job %s failed: its deadline of %gs passed", job.id, job.deadline_s)
        if job.state in LEASED and job.provider_id:
            self.job_events.cancel(moved)
            self.job_events.released(job.provider_id, job.id)
        self.hub.notify(job.id, ended=True)
        self.job_events.ended(moved)
        return moved

    def take_back(self, job: Job, kind: str, reason: str) -> Job | None:
        """Take a leased job away from its provider (lease expired, stalled): requeue or
        fail it, and only if that move happened free the slot and tell a zombie agent to
        stop (a job that settled in the meantime keeps both)."""
        moved = self._requeue(job, kind, reason)
        if moved is not None:
            self.job_events.released(job.provider_id, job.id)
            self.job_events.cancel(job)
        return moved

    def _requeue(self, job: Job, kind: str, reason: str, count_attempt: bool = True,
                 exclude: list[str] = (), logged: str | None = None) -> Job | None:
        """Back to the queue for another provider, or FAILED once attempts run out.
        ``exclude``: more exclusions (``operator:<account>`` ones are hard); ``logged``:
        what the log line says instead of ``reason`` (a provider's words stay out of it)."""
        used = job.attempt + 1
        if count_attempt and used >= job.max_attempts:
            return self._fail(job, "attempts_exhausted",
                              f"gave up after {used} attempts; last: {reason}")
        if job.deadline_s is not None and self.clock() > job.created_at + job.deadline_s:
            return self.expire(job, last=reason)
        excluded = sorted(set(job.excluded_providers) | {job.provider_id} | set(exclude))
        moved = self.repo.transition(
            job.id, [job.state], JobState.QUEUED, expect_attempt=job.attempt,
            expect_provider=job.provider_id,
            event=("requeued", {"reason": reason, "why": kind, "attempt": job.attempt + 1,
                                "provider_id": job.provider_id}),
            attempt=job.attempt + 1, provider_id=None, lease_expires_at=None, envelope=None,
            excluded_providers=excluded, progress_step=0, progress_total=0)
        if moved is not None:
            log.info("job %s requeued (%s): %s", job.id, kind,
                     reason if logged is None else logged)
            self.hub.notify(job.id)
            self.job_events.queued(moved)
        return moved

    def expire_unserved(self, limit: int = 500) -> list[Job]:
        """Fail the queued jobs (oldest ``limit``) whose build has had no provider for the
        presence window: no provider connected now serves it and none that does was seen
        within the window. Each fails ``no_provider`` with its hold voided (a full refund)
        and a ``failed`` event; the maintenance thread calls it every pass."""
        if self.builds_served is None:
            return []
        served: dict[tuple[str, str], bool] = {}
        gone = []
        for job in self.repo.queued(limit):
            build = (job.plugin, job.plugin_version)
            if build not in served:
                served[build] = self.builds_served.serves(*build)
            if served[build]:
                continue
            moved = self._fail(job, NO_PROVIDER,
                               f"no provider has served {job.plugin}@{job.plugin_version} for "
                               f"{self.builds_served.window_s:g} s (none connected, none "
                               "seen), so the job was given up and its hold released in full")
            if moved is not None:
                log.info("job %s failed: no provider served %s@%s for %gs", job.id,
                         job.plugin, job.plugin_version, self.builds_served.window_s)
                gone.append(moved)
        return gone

    def cancel(self, who: Principal, job_id: str, reason: str = "cancelled by client") -> Job:
        job = self.get(who, job_id)
        while not job.state.terminal:
            with self.repo.atomic():  # the cancellation with its payment or release
                moved = self.repo.transition(
                    job.id, [job.state], JobState.CANCELLED, expect_attempt=job.attempt,
                    event=("cancelled", {"reason": reason}), finished_at=self.clock(),
                    error_code="cancelled", error_message=reason)
                if moved is not None:
                    parts = self.checkpoints.parts(job) if self.checkpoints is not None else []
                    shown = self.shown_fraction(job)
                    if parts:  # resumed: earlier providers keep their shares
                        resumed = self.checkpoints.base_fraction(job)
                        self._money("cancel", job, lambda: self.billing.cancel_shared(
                            job, parts, resumed, reason, shown))
                    else:
                        self._money("cancel", job,
                                    lambda: self.billing.cancelled(job, reason, shown))
            if moved is not None:
                if job.state in LEASED and job.provider_id:
                    self.job_events.cancel(job)
                    self.job_events.released(job.provider_id, job.id)
                self.hub.notify(job.id, ended=True)
                self._ended(moved)
                self.job_events.ended(moved)
                return moved
            job = self.get(who, job_id)
        if job.state == JobState.CANCELLED:
            return job
        raise JobNotCancellable(f"job {job_id} is already {job.state.value}; only jobs that "
                                "have not finished can be cancelled")


class AssignmentTarget:
    """What the service needs of a connected agent to hand it a job (see dispatch.py)."""

    provider_id: str
    public_key: str

    def send_assignment(self, envelope_bytes: bytes, signature: str) -> None: ...
    def send_cancel(self, job_id: str, attempt: int, reason: str) -> None: ...


def _check_output(job_id: str, data: bytes, sha256: str) -> None:
    actual = sha256_hex(data)
    if sha256 and actual != sha256:
        raise ReceiptRefused("output_hash_mismatch",
                             f"output of job {job_id} hashes to {actual}, not {sha256}")
