"""Job states, the transitions allowed between them, and the job record the domain uses."""
from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class JobState(str, enum.Enum):
    QUEUED = "queued"
    MATCHED = "matched"
    RUNNING = "running"
    SUBMITTED = "submitted"
    VERIFYING = "verifying"
    DISPUTED = "disputed"
    SETTLED = "settled"
    REFUNDED = "refunded"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobState.SETTLED, JobState.REFUNDED, JobState.CANCELLED, JobState.FAILED})
LEASED = frozenset({JobState.MATCHED, JobState.RUNNING})

# DESIGN §2. Requeue (lease expired, provider failed or gave the job back) is
# MATCHED/RUNNING -> QUEUED with attempt + 1.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.MATCHED, JobState.CANCELLED, JobState.FAILED}),
    # MATCHED/RUNNING -> SETTLED: a verified receipt settles in one step while no
    # verification is required (the events still record "submitted" then "done").
    JobState.MATCHED: frozenset({JobState.RUNNING, JobState.SUBMITTED, JobState.SETTLED,
                                 JobState.QUEUED, JobState.CANCELLED, JobState.FAILED}),
    JobState.RUNNING: frozenset({JobState.SUBMITTED, JobState.SETTLED, JobState.QUEUED,
                                 JobState.CANCELLED, JobState.FAILED}),
    JobState.SUBMITTED: frozenset({JobState.VERIFYING, JobState.SETTLED, JobState.CANCELLED}),
    JobState.VERIFYING: frozenset({JobState.SETTLED, JobState.DISPUTED, JobState.CANCELLED}),
    JobState.DISPUTED: frozenset({JobState.SETTLED, JobState.REFUNDED}),
    JobState.SETTLED: frozenset(),
    JobState.REFUNDED: frozenset(),
    JobState.CANCELLED: frozenset(),
    JobState.FAILED: frozenset(),
}


def can_move(src: JobState, dst: JobState) -> bool:
    return dst in TRANSITIONS[src]


@dataclass
class Job:
    """A job as the domain sees it. Times are epoch seconds (float)."""

    id: str
    account_id: str
    plugin: str
    plugin_version: str
    inputs: dict[str, Any]
    state: JobState
    attempt: int = 0
    max_attempts: int = 3
    provider_id: str | None = None
    lease_expires_at: float | None = None
    work_units: float = 0.0
    progress_step: int = 0
    progress_total: int = 0
    error_code: str | None = None
    error_message: str | None = None
    receipt: dict | None = None
    receipt_signature: str | None = None
    envelope: dict | None = None
    excluded_providers: list[str] = field(default_factory=list)
    idempotency_key: str | None = None
    request_hash: str | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    matched_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    hold_id: str | None = None        # the ledger hold for the job's maximum price
    max_price_micro: int = 0          # that maximum (micro-credits)
    # The market (DESIGN §4): the client's priority and deadline, the clearing price paid to
    # the provider (set when the auction assigns the job), and split batches.
    priority: str = "standard"        # economy | standard | fast
    deadline_s: float | None = None   # seconds from submission the client will wait
    price_micro_per_unit: int | None = None
    batch_id: str | None = None       # siblings of one split request share it
    batch_index: int = 0
    # Verification (DESIGN §6): a check job re-runs ``check_of`` on another operator's
    # provider, no sooner than ``not_before``; ``verify`` is "sampled" or "always".
    check_of: str | None = None
    not_before: float | None = None
    verify: str = "sampled"
    # The weights digest the job must run on (None: any the plugin version's providers
    # serve); a check pins the digest of the weights the run it checks used.
    weights_digest: str | None = None
    request_id: str | None = None      # X-Request-Id of the request that created it
    # Issue #24: the image format the client asked for ({"format": "webp", "quality": 80};
    # None: the plugin's own, PNG); the result cache: the client opted in (``cache``), the
    # key a later job must match to be answered from this one, and for a job that was so
    # answered, the job whose outputs it got (``cached_from``).
    output_format: dict | None = None
    cache: bool = False
    cache_key: str | None = None
    cached_from: str | None = None


@dataclass
class JobOutput:
    job_id: str
    index: int
    sha256: str
    media_type: str
    size: int


@dataclass
class JobEvent:
    id: int
    job_id: str
    kind: str
    data: dict[str, Any]
    created_at: float


class SettledCopyCodec:
    """A settlement's copy of a job and its outputs (what :class:`~broker.jobs.hub.
    EventHub` keeps for waiters) as JSON for other broker replicas, so a client waiting on
    another replica gets its answer without reading back the row and outputs."""

    @staticmethod
    def encode(copy) -> dict:
        job, outputs = copy
        return {"job": job_to_wire(job), "outputs": [asdict(o) for o in outputs]}

    @staticmethod
    def decode(doc: dict):
        return job_from_wire(doc["job"]), tuple(JobOutput(**o) for o in doc["outputs"])


def job_to_wire(job: Job) -> dict:
    """The job as JSON (for a wake-up to another replica: see broker.replicas)."""
    doc = asdict(job)
    doc["state"] = job.state.value
    return doc


def job_from_wire(doc: dict) -> Job:
    """:func:`job_to_wire` back (raises TypeError/ValueError/KeyError on a bad document)."""
    doc = dict(doc)
    doc["state"] = JobState(doc["state"])
    return Job(**doc)


@dataclass(frozen=True)
class JobRequest:
    """What a client asks for, checked at the edge (``broker.api.job_request``) and shared by
    submit and quote: the build, the inputs as sent (the job service checks them against
    the manifest and fills the defaults), and the market and output options."""

    manifest: Any                    # sdk.protocol.manifest.Manifest of plugin@version
    inputs: Any                      # as the client sent them
    terms: dict[str, Any]            # priority, max_price_micro, deadline_s, n
    verify: str = "sampled"          # or "always"
    weights_digest: str | None = None
    output_format: dict | None = None  # None: the plugin's own
    cache: bool = False
