"""What clients and the dispatcher read of jobs: a job, a split's siblings, their events and
outputs, waiting for an end, and how much of a job's work a client was shown.

A part of :class:`broker.jobs.service.JobService` (which holds the state read here:
``repo``, ``hub``, ``blobs``, ``retention``, ``clock``).
"""
from __future__ import annotations

import time
from fractions import Fraction

from broker.auth.service import Principal
from .errors import JobNotFound, OutputExpired, OutputNotFound
from .checkpoints import steps_of
from .lease_check import is_uuid
from .hub import HubWait, Waiting, drive, quiet_slice_s
from .model import LEASED, Job, JobEvent, JobOutput


class JobQueries:
    """Reading jobs (a part of JobService)."""

    def batch(self, who: Principal, batch_id: str) -> list[Job]:
        """The siblings of a split request, in order (404 unless they are the caller's)."""
        jobs = self.repo.batch(batch_id) if is_uuid(batch_id) else []
        if not jobs or (jobs[0].account_id != who.account_id and who.role != "admin"):
            raise JobNotFound(f"no batch {batch_id!r} in your account")
        return jobs

    def get(self, who: Principal, job_id: str) -> Job:
        job = self.repo.get(job_id) if is_uuid(job_id) else None
        if job is None or (job.account_id != who.account_id and who.role != "admin"):
            raise JobNotFound(f"no job {job_id!r} in your account")
        return job

    def wait(self, who: Principal, job_id: str, timeout_s: float, job: Job | None = None) -> Job:
        """The job once it is terminal, or as it is when ``timeout_s`` passes (``job``: the
        caller's fresh copy, e.g. just submitted). Blocks this thread while it waits."""
        return drive(self.waiting(who, job_id, timeout_s, job), self.hub)

    def waiting(self, who: Principal, job_id: str, timeout_s: float,
                job: Job | None = None) -> Waiting[Job]:
        """:meth:`wait` as a generator that yields each wait on the hub instead of blocking
        (see :mod:`.hub`): the asyncio front waits on its event loop, holding no thread."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        version = self.hub.version(job_id)
        # A caller's copy is from before the version was read: a fast job may have ended in
        # between, and no later notification would come to say so.
        fresh = job is None or self.hub.ended(job_id)
        if fresh:
            job = self._ended_copy(who, job_id) or self.get(who, job_id)
        while not job.state.terminal:
            left = deadline - time.monotonic()
            if left <= 0:
                return job if fresh else self.get(who, job_id)
            seen = version
            version = yield HubWait(job_id, seen, min(left, quiet_slice_s()))
            # Every change here wakes the waiter (assigned, running, progress…); the hub
            # says whether it was the end. A quiet slice re-reads the row: the job may
            # have ended on another broker replica.
            if self.hub.ended(job_id):
                job, fresh = self._ended_copy(who, job_id) or self.get(who, job_id), True
            elif version == seen:
                job, fresh = self.get(who, job_id), True
            else:
                fresh = False
        return job

    def wait_batch(self, who: Principal, batch_id: str, timeout_s: float,
                   jobs: list[Job] | None = None) -> list[Job]:
        """A split request's siblings once all are terminal, or as they are when
        ``timeout_s`` passes (``jobs``: the caller's fresh copies, e.g. just submitted)."""
        return drive(self.waiting_batch(who, batch_id, timeout_s, jobs), self.hub)

    def waiting_batch(self, who: Principal, batch_id: str, timeout_s: float,
                      jobs: list[Job] | None = None) -> Waiting[list[Job]]:
        """:meth:`wait_batch` as a waiting generator (see :meth:`waiting`)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        out = []
        for job in (jobs or self.batch(who, batch_id)):
            out.append((yield from self.waiting(who, job.id, deadline - time.monotonic(),
                                                job=job)))
        return out

    def waiting_all(self, who: Principal, groups: list[list[Job]],
                    timeout_s: float) -> Waiting[list[list[Job]]]:
        """Every job of ``groups`` (a bulk request's items: a job, or a split's siblings)
        once all are terminal, or as they are when ``timeout_s`` passes; a waiting
        generator (see :meth:`waiting`)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        out = []
        for group in groups:
            ended = []
            for job in group:
                ended.append((yield from self.waiting(who, job.id,
                                                      deadline - time.monotonic(), job=job)))
            out.append(ended)
        return out

    def _ended_copy(self, who: Principal, job_id: str) -> Job | None:
        """The job as its settlement wrote it, while nothing has happened to it since
        (saves reading back what this process just wrote); None: read it."""
        held = self.hub.copy(job_id)
        if held is None or (held[0].account_id != who.account_id and who.role != "admin"):
            return None
        return held[0]

    def outputs_of(self, job: Job) -> list[JobOutput]:
        """A settled job's outputs: from its settlement's copy when ``job`` is that copy
        and nothing has happened to it since, else read."""
        held = self.hub.copy(job.id)
        if held is not None and held[0] is job:
            return list(held[1])
        return self.repo.outputs(job.id)

    def events(self, who: Principal, job_id: str, after_id: int = 0) -> list[JobEvent]:
        self.get(who, job_id)
        return self.repo.events_after(job_id, after_id)

    def outputs(self, who: Principal, job_id: str) -> list[JobOutput]:
        self.get(who, job_id)
        return self.repo.outputs(job_id)

    def output(self, who: Principal, job_id: str, index: int) -> tuple[JobOutput, bytes]:
        out = self.output_meta(who, job_id, index)
        return out, self.blobs.get(out.sha256)

    def output_meta(self, who: Principal, job_id: str, index: int) -> JobOutput:
        """Output ``index`` of the job; OutputExpired once retention deleted its bytes."""
        job = self.get(who, job_id)
        for out in self.repo.outputs(job_id):
            if out.index == index:
                if self.outputs_expired(job):
                    raise OutputExpired(
                        f"output {index} of job {job_id} was deleted: outputs are kept "
                        f"{self.retention.policy.output_retention_s:g} s after their job ends "
                        "(output_retention_s); run the job again to get it",
                        field="index")
                return out
        raise OutputNotFound(f"job {job_id} has no output {index}")

    def outputs_expired(self, job: Job) -> bool:
        return self.retention is not None and self.retention.expired(job.finished_at)

    def shown_fraction(self, job: Job) -> Fraction:
        """The share of ``job`` (0..1, of its whole work) that its current attempt has
        *shown* it did: the step of the latest checkpoint the broker received from that
        attempt, or the tokens it streamed (one ``token`` event each, counted from the
        resume step, over the job's steps: Llama's ``max_new_tokens``), whichever reaches
        further. What a cancelled job pays its current provider for; reported progress
        is not counted (a provider says 100 % as easily as 10 %). 0 for a job no provider
        holds now."""
        if job.state not in LEASED or not job.provider_id:
            return Fraction(0)
        shown = Fraction(0)
        resumed = Fraction(0)
        if self.checkpoints is not None:
            resumed = self.checkpoints.base_fraction(job)
            shown = resumed
            for rec in self.checkpoints.credited(job):  # only those the broker asked for
                if rec.attempt == job.attempt:
                    shown = max(shown, Fraction(min(rec.step, rec.total), rec.total))
        steps = steps_of(job)
        if steps > 0:
            tokens = self._tokens_streamed(job, limit=steps)
            if tokens:
                shown = max(shown, min(Fraction(1), resumed + Fraction(tokens, steps)))
        return min(Fraction(1), shown)

    def _tokens_streamed(self, job: Job, limit: int) -> int:
        """``token`` events of the job's current attempt (after its ``assigned`` event),
        counted up to ``limit``."""
        count, after, attempt_started = 0, 0, False
        while True:
            events = self.repo.events_after(job.id, after)
            if not events:
                return count
            for e in events:
                if e.kind == "assigned":
                    attempt_started = e.data.get("attempt") == job.attempt
                    count = 0
                elif e.kind == "token" and attempt_started:
                    count += 1
            if count >= limit and attempt_started:
                return limit
            after = events[-1].id

    # ---- dispatch --------------------------------------------------------------------
    def queued(self, limit: int = 200) -> list[Job]:
        return self.repo.queued(limit)

