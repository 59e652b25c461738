"""Whether an attempt of a job is leased to a provider: the one check the job service and
its checkpoints make before acting on what an agent sends about a job."""
from __future__ import annotations

import uuid

from .errors import ReceiptRefused
from .model import LEASED, Job, JobState
from .ports import JobRepository


def is_uuid(value: str) -> bool:
    try:
        uuid.UUID(str(value))
        return True
    except ValueError:
        return False


def check_lease(job_id: str, provider_id: str, attempt: int,
                lease: tuple[JobState, str | None, int] | None) -> None:
    """Refuse unless ``lease`` (state, holder, attempt) says ``attempt`` of the job is
    leased to ``provider_id``."""
    if lease is None:
        raise ReceiptRefused("unknown_job", f"no job {job_id!r}")
    state, holder, current = lease
    if holder != provider_id or current != attempt or state not in LEASED:
        raise ReceiptRefused("not_your_job",
                             f"job {job_id} attempt {attempt} is not leased to you (it is "
                             f"{state.value}, attempt {current})")


def leased_job(repo: JobRepository, provider_id: str, job_id: str, attempt: int,
               job: Job | None = None) -> Job:
    """The job if ``attempt`` of it is leased to ``provider_id`` (``job``: as just read)."""
    if job is None:
        job = repo.get(job_id) if is_uuid(job_id) else None
    check_lease(job_id, provider_id, attempt,
                None if job is None else (job.state, job.provider_id, job.attempt))
    return job
