"""Checkpoints of running jobs and what they do for a job that moves (DESIGN §2).

For a job long enough to be worth it, the envelope asks the plugin for a checkpoint every
``k`` steps (``"checkpoint_every"``). The agent uploads each one; the broker keeps the bytes
in the blob store and the latest per attempt in a :class:`CheckpointRepository`. When the
job is requeued, the next envelope names the latest one (``"resume": {"sha256", "step",
"total"}``) and the new provider fetches it over its stream.

Only checkpoints the broker asked for are kept (issue #20): the envelope asked for them,
the total is the job's own step count (:func:`steps_of`) and the step lies inside the
attempt; what a resume or a cancel credits is read through
:meth:`CheckpointService.credited`.

Money: the provider of an attempt that ended after a checkpoint the job later resumed from
is paid for the steps it added (its checkpoint's step less the step it started from); the
provider that finishes is paid for the rest. :meth:`CheckpointService.parts` lists the
earlier shares; ``broker.billing.shared`` posts them with the final one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

from sdk.protocol.canonical import sha256_hex

from .errors import ReceiptRefused
from .hub import EventHub
from .lease_check import leased_job
from .model import Job
from .ports import BlobStore, JobRepository

MAX_CHECKPOINT_BYTES = 64 * 1024 * 1024  # one gRPC message


@dataclass(frozen=True)
class CheckpointRecord:
    job_id: str
    attempt: int
    provider_id: str
    base_step: int          # the step this attempt started from (0, or its resume step)
    step: int               # steps done when the checkpoint was written
    total: int
    sha256: str
    size: int
    rate_micro_per_unit: int | None
    created_at: float


class CheckpointRepository(Protocol):
    def save(self, rec: CheckpointRecord) -> bool:
        """Store or advance the attempt's latest checkpoint (never move it back)."""

    def for_job(self, job_id: str) -> list[CheckpointRecord]:
        """All attempts' latest checkpoints, oldest attempt first."""


class InMemoryCheckpointRepository:
    def __init__(self) -> None:
        self.rows: dict[tuple[str, int], CheckpointRecord] = {}

    def save(self, rec: CheckpointRecord) -> bool:
        old = self.rows.get((rec.job_id, rec.attempt))
        if old is not None and old.step >= rec.step:
            return False
        self.rows[(rec.job_id, rec.attempt)] = rec
        return True

    def for_job(self, job_id: str) -> list[CheckpointRecord]:
        return sorted((r for r in self.rows.values() if r.job_id == job_id),
                      key=lambda r: r.attempt)


@dataclass
class CheckpointPolicy:
    """``min_steps``: jobs with fewer steps never checkpoint; ``every_steps``: the interval
    (0: about ``per_job`` checkpoints per job)."""

    min_steps: int = 8
    every_steps: int = 0
    per_job: int = 4

    def every(self, job: Job) -> int:
        steps = steps_of(job)
        if steps < max(2, self.min_steps):
            return 0
        if self.every_steps > 0:
            return self.every_steps
        return max(1, steps // (self.per_job + 1))


def steps_of(job: Job) -> int:
    """The steps a run of the job counts, from the job's own inputs as the broker holds
    them (diffusion steps, echo steps, Llama's new tokens): the ``total`` its progress and
    checkpoints report. Image-to-image (an ``init_image`` with a ``strength``) runs the
    denoising steps diffusers keeps, ``min(int(steps * strength), steps)``
    (``StableDiffusionImg2ImgPipeline.get_timesteps``), 0 when that leaves none (the
    plugin refuses such a job)."""
    inputs = job.inputs or {}
    for name in ("steps", "max_new_tokens"):
        value = inputs.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            strength = inputs.get("strength")
            if (name == "steps" and inputs.get("init_image")
                    and isinstance(strength, (int, float)) and not isinstance(strength, bool)):
                return max(0, min(int(value * strength), value))
            return value
    return 0


@dataclass(frozen=True)
class Part:
    """An earlier attempt's share of a job: ``fraction`` of its work units."""

    provider_id: str
    attempt: int
    fraction: Fraction
    rate_micro_per_unit: int | None


class CheckpointService:
    """Built before the job service and passed to it (``JobService(checkpoints=...)``): it
    reads and writes what the job service does, the jobs' rows and events (``jobs``), their
    blob store (``blobs``) and the hub that wakes a job's followers (``hub``)."""

    def __init__(self, repo: CheckpointRepository, policy: CheckpointPolicy | None = None, *,
                 jobs: JobRepository, blobs: BlobStore, hub: EventHub, clock=time.time):
        self.job_repo = jobs
        self.blobs = blobs
        self.hub = hub
        self.repo = repo
        self.policy = policy or CheckpointPolicy()
        self.clock = clock

    # ---- envelopes -------------------------------------------------------------------
    def envelope_extra(self, job: Job) -> dict:
        """What the envelope of ``job``'s next attempt says about checkpoints."""
        extra: dict = {}
        every = self.policy.every(job)
        if every:
            extra["checkpoint_every"] = every
        latest = self.latest(job, before_attempt=job.attempt)
        if latest is not None:
            extra["resume"] = {"sha256": latest.sha256, "step": latest.step,
                               "total": latest.total}
        return extra

    def latest(self, job: Job, before_attempt: int | None = None) -> CheckpointRecord | None:
        if before_attempt is not None and before_attempt <= 0:
            return None  # attempts count from 0: a first attempt has nothing to resume
        rows = [r for r in self.credited(job)
                if before_attempt is None or r.attempt < before_attempt]
        return max(rows, key=lambda r: (r.step, r.attempt), default=None)

    # ---- agents ----------------------------------------------------------------------
    def upload(self, provider_id: str, job_id: str, attempt: int, step: int, total: int,
               data: bytes, sha256: str, stored: bool = False) -> CheckpointRecord | None:
        """Keep a checkpoint of the attempt ``provider_id`` holds; idempotent (the same or
        an older checkpoint again changes nothing). ``stored``: the agent PUT the bytes
        into the blob store itself (a presigned URL); the stored object's checksum is
        checked instead."""
        job = leased_job(self.job_repo, provider_id, job_id, attempt)
        base = self._admissible(job, step, total)
        if stored:
            state = self.blobs.check(sha256) if sha256 else "missing"
            if state != "ok":
                raise ReceiptRefused(
                    "checkpoint_missing" if state == "missing" else "checkpoint_hash_mismatch",
                    f"checkpoint {sha256[:12]}… of job {job_id} is "
                    f"{'not in the blob store' if state == 'missing' else 'stored as other bytes'}"
                    "; PUT it with the URL from an UploadRequest first")
            actual, size = sha256, self.blobs.size(sha256)
        else:
            if len(data) > MAX_CHECKPOINT_BYTES:
                raise ReceiptRefused("checkpoint_too_large", f"checkpoint of {len(data)} bytes; "
                                     f"at most {MAX_CHECKPOINT_BYTES} are kept")
            actual = sha256_hex(data)
            if sha256 and actual != sha256:
                raise ReceiptRefused("checkpoint_hash_mismatch",
                                     f"checkpoint of job {job_id} hashes to {actual}, not {sha256}")
            self.blobs.put(data)
            size = len(data)
        rec = CheckpointRecord(job_id=job.id, attempt=attempt, provider_id=provider_id,
                               base_step=base, step=step, total=total, sha256=actual,
                               size=size,
                               rate_micro_per_unit=getattr(job, "price_micro_per_unit", None),
                               created_at=self.clock())
        if self.repo.save(rec):
            self.job_repo.add_event(job.id, "checkpoint", {"attempt": attempt, "step": step,
                                                          "total": total, "sha256": actual})
            self.hub.notify(job.id)
            return rec
        return None

    def _admissible(self, job: Job, step: int, total: int) -> int:
        """The step ``job``'s current attempt started from, once a checkpoint at ``step`` of
        ``total`` is one the broker asked for: the envelope asked for checkpoints, ``total``
        is the job's own step count (:func:`steps_of`, never the agent's word) and ``step``
        lies past where the attempt started and short of the end (a run's last step ends
        with its receipt). Raises :class:`ReceiptRefused` naming what is wrong."""
        envelope = job.envelope or {}
        if not int(envelope.get("checkpoint_every") or 0):
            raise ReceiptRefused(
                "checkpoint_not_asked", f"job {job.id} attempt {job.attempt} asked for no "
                "checkpoints (its envelope has no checkpoint_every); none is kept")
        expected = steps_of(job)
        if total != expected:
            raise ReceiptRefused(
                "bad_checkpoint_total", f"checkpoint of a {total}-step run; job {job.id} runs "
                f"{expected} steps by its inputs (image-to-image: min(int(steps × strength), "
                "steps)), the total its checkpoints must name")
        base = int((envelope.get("resume") or {}).get("step", 0))
        if not base < step < total:
            raise ReceiptRefused(
                "bad_checkpoint_step", f"checkpoint at step {step} of {total}; this attempt "
                f"started at step {base}, so a checkpoint lies after it and before step {total}")
        return base

    def credited(self, job: Job) -> list[CheckpointRecord]:
        """``job``'s checkpoints that count (for a resume and for what a cancel pays): those
        :meth:`upload` would take now. A row kept before the broker checked the total
        against the job's steps, with another total or a step outside it, is passed over."""
        total = steps_of(job)
        return [r for r in self.repo.for_job(job.id)
                if r.total == total and r.base_step < r.step < r.total]

    def fetch(self, provider_id: str, job_id: str, attempt: int, sha256: str) -> bytes:
        """The checkpoint the envelope of the attempt ``provider_id`` holds names."""
        self._resumes_from(provider_id, job_id, attempt, sha256)
        return self.blobs.get(sha256)

    def fetch_url(self, provider_id: str, job_id: str, attempt: int, sha256: str) -> str:
        """As :meth:`fetch`, a presigned GET URL of the checkpoint (stores that presign)."""
        self._resumes_from(provider_id, job_id, attempt, sha256)
        if not self.blobs.exists(sha256):
            raise ReceiptRefused("checkpoint_missing", f"checkpoint {sha256[:12]}… is no "
                                 "longer in the blob store")
        return self.blobs.presign_get(sha256)[0]

    def _resumes_from(self, provider_id: str, job_id: str, attempt: int, sha256: str) -> None:
        job = leased_job(self.job_repo, provider_id, job_id, attempt)
        resume = (job.envelope or {}).get("resume") or {}
        if not sha256 or resume.get("sha256") != sha256:
            raise ReceiptRefused("unknown_checkpoint",
                                 f"job {job_id} attempt {attempt} resumes from no checkpoint "
                                 f"{sha256[:12]}")

    # ---- money -----------------------------------------------------------------------
    def parts(self, job: Job) -> list[Part]:
        """Earlier attempts' shares of ``job``: walk back to step 0 from the checkpoint its
        current attempt resumed from (``job.envelope["resume"]``) or, for a job waiting in
        the queue, from the latest checkpoint."""
        if job.envelope is not None:
            step = int(((job.envelope or {}).get("resume") or {}).get("step", 0))
        else:
            latest = self.latest(job, before_attempt=job.attempt)
            step = latest.step if latest is not None else 0
        if step <= 0:
            return []
        rows = [r for r in self.credited(job) if r.attempt < job.attempt]
        parts: list[Part] = []
        while step > 0:
            row = max((r for r in rows if r.step == step and r.base_step < step),
                      key=lambda r: r.attempt, default=None)
            if row is None:
                break  # cannot happen for envelopes this service wrote
            parts.append(Part(row.provider_id, row.attempt,
                              Fraction(row.step - row.base_step, row.total),
                              row.rate_micro_per_unit))
            step = row.base_step
            rows = [r for r in rows if r.attempt < row.attempt]
        return parts

    def saved_parts(self, job: Job) -> list[Part]:
        """Every share of ``job`` a checkpoint saved: the current attempt's latest
        checkpoint (while it is leased) and the earlier attempts' (:meth:`parts`). What a
        job given up at its deadline still pays for."""
        parts = self.parts(job)
        if job.envelope is None or not job.provider_id:
            return parts
        base = int(((job.envelope or {}).get("resume") or {}).get("step", 0))
        own = max((r for r in self.credited(job)
                   if r.attempt == job.attempt and r.provider_id == job.provider_id
                   and r.step > base), key=lambda r: r.step, default=None)
        if own is not None:
            parts.insert(0, Part(own.provider_id, own.attempt,
                                 Fraction(own.step - base, own.total), own.rate_micro_per_unit))
        return parts

    def base_fraction(self, job: Job) -> Fraction:
        """The share of ``job`` its current attempt did not do (it resumed past it)."""
        resume = (job.envelope or {}).get("resume") or {}
        step, total = int(resume.get("step", 0)), steps_of(job)
        return (Fraction(step, total) if int(resume.get("total", 0)) == total and 0 < step < total
                else Fraction(0))
