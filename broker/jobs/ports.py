"""What the job service needs from storage and from the blob store (implemented elsewhere)."""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Iterable, Protocol

from .model import Job, JobEvent, JobOutput, JobState


class JobRepository(Protocol):
    def atomic(self) -> AbstractContextManager:
        """A block whose writes here, in the ledger and in the audit log commit as one
        transaction (a job with its hold, a settlement with its post)."""

    def flat(self) -> AbstractContextManager:
        """Inside an ``atomic`` block: the writes here run without a savepoint each, so a
        failed one undoes the whole block (for a caller that then redoes its work another
        way); outside one, no change."""

    def create(self, job: Job, first_event: tuple[str, dict]) -> tuple[Job, bool]:
        """Insert ``job`` with its first event. When (account, idempotency key) already
        exists, return the existing job and False instead."""

    def get(self, job_id: str) -> Job | None: ...

    def lease_of(self, job_id: str) -> tuple[JobState, str | None, int] | None:
        """Just the job's (state, provider id, attempt): a cheap read for checks that need
        no more (an agent's output upload); None when there is no such job."""

    def list_for_account(self, account_id: str, limit: int = 50) -> list[Job]: ...

    def batch(self, batch_id: str) -> list[Job]:
        """The siblings of a split request, ordered by ``batch_index``."""

    def queued(self, limit: int) -> list[Job]:
        """Oldest queued jobs first."""

    def transition(self, job_id: str, expect: Iterable[JobState], to: JobState, *,
                   expect_attempt: int | None = None, expect_provider: str | None = None,
                   event: tuple[str, dict] | None = None,
                   events: list[tuple[str, dict]] | None = None,
                   outputs: list[JobOutput] | None = None, **fields) -> Job | None:
        """Atomically move the job to ``to`` (setting ``fields``) if it is in one of
        ``expect`` (and at ``expect_attempt`` / held by ``expect_provider`` when given);
        append ``event``/``events`` and insert ``outputs`` in the same transaction. Returns the new job, or None when the
        job was not in an expected state (someone else moved it first)."""

    def deferred_rows(self) -> AbstractContextManager[None]:
        """Inside ``atomic``: the events and outputs this thread's transitions write in the
        block are written together as it ends, in the same transaction."""

    def add_event(self, job_id: str, kind: str, data: dict, **fields) -> int:
        """Append an event (and update ``fields`` on the job); returns its id."""

    def events_after(self, job_id: str, after_id: int, limit: int = 500) -> list[JobEvent]: ...

    def expired_leases(self, now: float, limit: int = 100) -> list[Job]: ...

    def overdue(self, now: float, limit: int = 100) -> list[Job]:
        """Queued or leased jobs whose ``created_at + deadline_s`` is before ``now``."""
        ...

    def extend_leases(self, provider_id: str, job_ids: list[str], until: float) -> int: ...

    def leased_to(self, provider_id: str) -> list[Job]: ...

    def outputs(self, job_id: str) -> list[JobOutput]: ...

    def counts_by_state(self) -> dict[str, int]: ...

    def replace_outputs(self, job_id: str, outputs: list[JobOutput],
                        event: tuple[str, dict]) -> None: ...

    def checks_of(self, job_id: str) -> list[Job]: ...

    def cache_sources(self, cache_key: str, limit: int = 5) -> list[Job]:
        """Settled jobs, not cache answers themselves, with this result-cache key."""


class BuildsServed(Protocol):
    """Whether some provider known to the broker serves a plugin build (connected now, or
    seen within ``window_s``): broker.providers.presence.BuildsServed."""

    window_s: float

    def serves(self, plugin: str, version: str) -> bool: ...


class StakeCheck(Protocol):
    """Whether a provider may take a plugin's jobs: it holds the plugin's minimum stake
    (DESIGN §6; broker.verification, through the relay the wiring builds before it)."""

    def stake_ok(self, provider_id: str, plugin: str) -> bool: ...


class BlobStore(Protocol):
    """Content-addressed blobs (broker.blobs: a local folder, or S3 through boto3). The
    contract both keep is tests/unit/broker/test_blob_stores.py."""

    presigns: bool  # True: presign_put/presign_get work (bytes bypass the broker)

    def put(self, data: bytes) -> str:
        """Store ``data``; returns its key (its sha256 hex)."""

    def get(self, key: str) -> bytes: ...

    def exists(self, key: str) -> bool: ...

    def check(self, key: str) -> str:
        """"ok" (stored as the bytes its key names), "missing", "no_checksum" or
        "mismatch" (the last two: an object store's object changed behind the broker)."""

    def delete(self, key: str) -> bool: ...

    def usage(self) -> tuple[int, int]:
        """(blobs, bytes) stored."""

    def presign_put(self, key: str, size: int | None = None):
        """broker.blobs.model.PresignedPut: a URL storing only the bytes of ``key``."""

    def presign_get(self, key: str, ttl_s: float | None = None,
                    media_type: str | None = None,
                    attachment: bool = False) -> tuple[str, float]:
        """(url, expires at): a URL anyone holding it may GET the blob with."""


class JobMetrics(Protocol):
    """What the job service tells the broker's metrics (broker.observability.metrics);
    each call costs a dictionary look-up and an increment."""

    def submitted(self, plugin: str, n: int = 1) -> None: ...

    def placed(self, plugin: str, waited_s: float) -> None:
        """A job was leased after waiting ``waited_s`` in the queue."""

    def ended(self, plugin: str, state: str, age_s: float) -> None:
        """A job reached an end state ``age_s`` after it was submitted."""

    def settled(self, plugin: str, settle_s: float) -> None:
        """A receipt settled its job ``settle_s`` after it arrived."""


class NoMetrics:
    """A JobMetrics that keeps nothing (metrics off, unit tests)."""

    def submitted(self, plugin: str, n: int = 1) -> None:
        pass

    def placed(self, plugin: str, waited_s: float) -> None:
        pass

    def ended(self, plugin: str, state: str, age_s: float) -> None:
        pass

    def settled(self, plugin: str, settle_s: float) -> None:
        pass
