"""Disputes: a job whose verification runs disagreed (DESIGN §6), as admins see and judge
them.

Verification (``broker/verification``) opens a dispute with :meth:`DisputeService.open`
once a 2-of-3 outcome exists, giving every side's output and the comparison figures.
An admin may override the outcome with a required reason; the service's ``resolutions``
(verification, passed at construction) apply the money consequences (forfeit, slash,
refund) of the final word.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from broker.errors import BrokerError, NotFound


class DisputeError(BrokerError):
    code, http_status, grpc_status, title = ("invalid_dispute", 422, "INVALID_ARGUMENT",
                                             "Invalid dispute action")


class DisputeAlreadyResolved(BrokerError):
    code, http_status, grpc_status, title = ("dispute_resolved", 409, "FAILED_PRECONDITION",
                                             "Dispute already resolved")


@dataclass
class Dispute:
    """``sides``: one per run, ``{"provider_id", "job_id", "output_index", "sha256",
    "media_type", "verdict"}`` with verdict ``"majority"`` or ``"minority"``;
    ``comparisons``: the figures the decision used (``ssim``, ``psnr_db``,
    ``phash_distance``, ``latent_hash_equal``, ``token_rank_ok`` …); ``outcome``: the 2-of-3
    result in words; ``resolution``: the admin's word, once given."""

    id: str
    job_id: str
    plugin: str
    state: str = "open"  # open | resolved
    opened_at: float = 0.0
    outcome: str = ""
    sides: list[dict[str, Any]] = field(default_factory=list)
    comparisons: dict[str, Any] = field(default_factory=dict)
    resolution: dict[str, Any] | None = None


class DisputeRepository(Protocol):
    def add(self, dispute: Dispute) -> None: ...
    def get(self, dispute_id: str) -> Dispute | None: ...
    def list(self, state: str | None = None, limit: int = 100) -> list[Dispute]: ...
    def resolve(self, dispute_id: str, resolution: dict) -> bool:
        """Set the resolution of an *open* dispute; False if it was not open."""


class Resolutions(Protocol):
    """Who carries out an admin's override of a dispute (verification, DESIGN §6:
    ``VerificationService.admin_resolved``): the chosen run's output, slashes, refunds."""

    def admin_resolved(self, dispute: Dispute) -> None: ...


class DisputeService:
    def __init__(self, repo: DisputeRepository, audit=None, clock=time.time,
                 resolutions: Resolutions | None = None):
        self.repo = repo
        self.audit = audit
        self.clock = clock
        self.resolutions = resolutions  # None: an override is recorded, nothing more

    def open(self, job_id: str, plugin: str, sides: list[dict], comparisons: dict,
             outcome: str, *, by: str = "verification") -> Dispute:
        if len(sides) < 2:
            raise DisputeError(f"a dispute needs at least two sides; got {len(sides)}")
        d = Dispute(id=str(uuid.uuid4()), job_id=job_id, plugin=plugin, opened_at=self.clock(),
                    outcome=outcome, sides=list(sides), comparisons=dict(comparisons))
        self.repo.add(d)
        if self.audit:
            self.audit.record(by, "dispute.open", f"job:{job_id}",
                              {"dispute": d.id, "outcome": outcome, "comparisons": comparisons,
                               "providers": [s.get("provider_id") for s in sides]})
        return d

    def get(self, dispute_id: str) -> Dispute:
        d = self.repo.get(dispute_id)
        if d is None:
            raise NotFound(f"no dispute {dispute_id!r}")
        return d

    def list(self, state: str | None = None) -> list[Dispute]:
        return self.repo.list(state)

    def override(self, dispute_id: str, winner_provider_id: str, reason: str, *, by: str) -> Dispute:
        """The admin's final word: ``winner_provider_id``'s output stands."""
        reason = (reason or "").strip()
        if not reason:
            raise DisputeError("a reason is required to override a dispute's outcome")
        d = self.get(dispute_id)
        if winner_provider_id not in {s.get("provider_id") for s in d.sides}:
            raise DisputeError(f"provider {winner_provider_id!r} is not a side of dispute {d.id}")
        resolution = {"winner_provider_id": winner_provider_id, "reason": reason, "by": by,
                      "at": self.clock(), "previous_outcome": d.outcome}
        if not self.repo.resolve(d.id, resolution):
            raise DisputeAlreadyResolved(f"dispute {d.id} was already resolved; reload the page")
        if self.audit:
            self.audit.record(f"admin:{by}", "dispute.override", f"job:{d.job_id}",
                              {"dispute": d.id, "before": d.outcome,
                               "after": f"{winner_provider_id} stands", "reason": reason})
        d = self.get(d.id)
        if self.resolutions is not None:
            self.resolutions.admin_resolved(d)
        return d
