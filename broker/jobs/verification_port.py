"""The job service as verification sees it (``broker.verification.ports.CheckedJobs``):
reads of jobs and their outputs, events, a check queued or given up. Built once in the
wiring and passed to ``VerificationService`` at construction."""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable

from .model import Job, JobOutput
from .service import JobService


class JobsForVerification:
    def __init__(self, jobs: JobService):
        self._jobs = jobs

    def get(self, job_id: str) -> Job | None:
        return self._jobs.repo.get(job_id)

    def outputs(self, job_id: str) -> list[JobOutput]:
        return self._jobs.repo.outputs(job_id)

    def output_bytes(self, sha256: str) -> bytes:
        return self._jobs.blobs.get(sha256)

    def replace_outputs(self, job_id: str, outputs: list[JobOutput],
                        event: tuple[str, dict]) -> None:
        self._jobs.repo.replace_outputs(job_id, outputs, event)

    def atomic(self) -> AbstractContextManager:
        return self._jobs.repo.atomic()

    def add_event(self, job_id: str, kind: str, data: dict) -> None:
        self._jobs.repo.add_event(job_id, kind, data)
        self._jobs.hub.notify(job_id)

    def give_up(self, job: Job, code: str, message: str) -> Job | None:
        return self._jobs.give_up(job, code, message)

    def submit_check(self, primary: Job, check_id: str, account_id: str, inputs: dict,
                     excluded: list[str], *, not_before: float,
                     fund: Callable[[str, int], None] | None = None) -> Job:
        return self._jobs.submit_check(primary, check_id, account_id, inputs, excluded,
                                       not_before=not_before, fund=fund)
