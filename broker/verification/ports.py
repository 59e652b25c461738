"""What verification needs of the job service: the port it is given at construction
(``broker.jobs.verification_port.JobsForVerification`` implements it over JobService), so
it never reaches into the job service's repository, event hub or blob store."""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable, Protocol

from broker.jobs.model import Job, JobOutput


class CheckedJobs(Protocol):
    def get(self, job_id: str) -> Job | None:
        """The job as stored now (None: no such job)."""

    def outputs(self, job_id: str) -> list[JobOutput]:
        """The job's outputs as stored, in index order."""

    def output_bytes(self, sha256: str) -> bytes:
        """The bytes of one output (a failed read raises)."""

    def replace_outputs(self, job_id: str, outputs: list[JobOutput],
                        event: tuple[str, dict]) -> None:
        """Give the job other outputs (an overturned job gets the majority's), with the
        event that says why."""

    def atomic(self) -> AbstractContextManager:
        """A block whose writes to jobs, the ledger and the audit log commit as one."""

    def add_event(self, job_id: str, kind: str, data: dict) -> None:
        """Append an event to the job and wake whoever follows it."""

    def give_up(self, job: Job, code: str, message: str) -> Job | None:
        """Fail a job nobody ran (a check past its timeout); None when it moved first."""

    def submit_check(self, primary: Job, check_id: str, account_id: str, inputs: dict,
                     excluded: list[str], *, not_before: float,
                     fund: Callable[[str, int], None] | None = None) -> Job:
        """Queue a run of ``primary``'s build on ``inputs`` (a check or a third run) with
        id ``check_id``, held against ``account_id`` (``fund`` first pays that hold for
        platform-sampled checks), never on ``excluded`` providers or operators."""
