"""Errors of the auction domain.

Every error carries a stable ``code``, an HTTP status and a gRPC status *name* (via
:class:`broker.errors.BrokerError`, which is plain Python: no transport is imported); the
broker's one error handler renders them, including the structured fields passed as extras
(``field``, ``reasons``, ``best_price_micro``...).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker.errors import BrokerError


class AuctionError(BrokerError):
    """Root of the auction's errors."""

    code = "auction_error"
    http_status = 400
    grpc_status = "INVALID_ARGUMENT"
    title = "Auction error"


class InvalidAsk(AuctionError):
    """A standing ask was refused; the provider's previous valid ask (if any) still stands."""

    code = "invalid_ask"
    title = "Invalid ask"

    def __init__(self, field: str, value: Any, allowed: str, *, provider_id: str | None = None):
        self.field = field
        self.value = value
        self.allowed = allowed
        self.provider_id = provider_id
        who = f" from provider {provider_id!r}" if provider_id else ""
        super().__init__(
            f"invalid ask{who}: {field} must be {allowed}; got {value!r}. "
            "The previous valid ask, if any, still stands; post a corrected ask.",
            field=field)


class InvalidJob(AuctionError):
    """A job specification the auction cannot clear (zero work, bad slot count...)."""

    code = "invalid_job"
    http_status = 422
    title = "Invalid job"

    def __init__(self, field: str, value: Any, allowed: str):
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid job: {field} must be {allowed}; got {value!r}", field=field)


class UnknownAsk(AuctionError):
    """No standing ask under that key."""

    code = "unknown_ask"
    http_status = 404
    grpc_status = "NOT_FOUND"
    title = "Unknown ask"


class NoMatch(AuctionError):
    """The job cannot clear now. Carries why (``reasons``: providers per reason, e.g.
    ``{"busy": 1, "above the reserve": 2}``) and the best terms the market could offer
    (``best_price_micro`` for the whole job, ``best_completion_s``), or None where there are
    none. Asks are never included: only counts and prices the clearing rule would charge."""

    code = "no_match"
    http_status = 409
    grpc_status = "FAILED_PRECONDITION"
    title = "No match"

    def __init__(self, message: str, *, reasons: Mapping[str, int],
                 best_price_micro: int | None = None, best_completion_s: float | None = None):
        self.reasons = dict(reasons)
        self.best_price_micro = best_price_micro
        self.best_completion_s = best_completion_s
        super().__init__(message, reasons=self.reasons, best_price_micro=best_price_micro,
                         best_completion_s=best_completion_s)


class NoEligibleProvider(NoMatch):
    """No standing ask passes eligibility (plugin version and weights, VRAM, measured
    throughput, reputation, reserve, not linked, online, free slot). The job should wait
    in the queue: capacity may appear."""

    code = "no_eligible_provider"
    http_status = 503
    grpc_status = "UNAVAILABLE"
    title = "No eligible provider"


class CannotMeetTerms(NoMatch):
    """Eligible providers exist, but none can meet the client's ``max_price_micro`` or
    ``deadline_s``; ``best_price_micro`` / ``best_completion_s`` say what the market can do."""

    code = "cannot_meet_terms"
    title = "Cannot meet the job's terms"
