"""Errors the SDK raises: one class per failure kind. Every one carries ``code`` (the
broker's stable problem code, or the SDK's own for failures that never reached it) and
``request_id`` (the ``X-Request-Id`` of the answer, None when there was none), so a report
can quote both."""
from __future__ import annotations

from typing import Any


class SparecyclesError(Exception):
    """Root of every SDK error."""

    code: str = "error"
    request_id: str | None = None


class ConfigurationError(SparecyclesError):
    """The client is missing something it needs (an API key, a URL)."""

    code = "configuration"


class APIConnectionError(SparecyclesError):
    """The broker could not be reached (after retries)."""

    code = "connection_error"


class APIError(SparecyclesError):
    """The broker answered with an RFC 7807 problem."""

    def __init__(self, status: int, code: str, detail: str, *, field: str | None = None,
                 request_id: str | None = None, body: dict | None = None):
        super().__init__(f"{detail} [{code}, HTTP {status}]")
        self.status = status
        self.code = code
        self.detail = detail
        self.field = field
        self.request_id = request_id
        self.body = body or {}


class AuthenticationError(APIError):
    pass


class PermissionDeniedError(APIError):
    pass


class NotFoundError(APIError):
    pass


class ConflictError(APIError):
    pass


class InsufficientCreditsError(APIError):
    """HTTP 402: the balance does not cover the job's maximum price (``body`` has
    ``needed_micro``, ``available_micro``, ``shortfall_micro``)."""


class InvalidInputError(APIError):
    """Inputs outside the plugin's schema (raised before sending when the SDK can tell)."""


class ServerError(APIError):
    pass


class RateLimitError(APIError):
    """HTTP 429 after the retries: ``retry_after_s`` is what the broker's ``Retry-After``
    asked for (None when it gave none). The client already waited that long between its
    retries; wait this long before the next request."""

    def __init__(self, *args, retry_after_s: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.retry_after_s = retry_after_s


class JobFailedError(SparecyclesError):
    """The job ended without a result; ``job`` is attached."""

    def __init__(self, job: Any, message: str):
        super().__init__(message)
        self.job = job
        data = getattr(job, "data", job) if job is not None else {}
        err = (data.get("error") if isinstance(data, dict) else None) or {}
        self.code = str(err.get("code") or ("job_" + str(data.get("state", "failed"))
                                            if isinstance(data, dict) else "job_failed"))
        # The request that created the job (as the broker keeps it), as an APIError's.
        self.request_id = (data.get("request_id") if isinstance(data, dict)
                           else getattr(job, "request_id", None))


class JobTimeoutError(JobFailedError):
    """``wait()`` ran out of time; the job was cancelled on the broker. ``timeout_s`` is
    the timeout the caller gave, ``waited_s`` how long it waited, ``charged_micro`` what
    the cancel charged (the provider is paid for the work it showed; None: unknown)."""

    def __init__(self, job: Any, message: str, *, timeout_s: float | None = None,
                 waited_s: float | None = None, charged_micro: int | None = None):
        super().__init__(job, message)
        self.timeout_s = timeout_s
        self.waited_s = waited_s
        self.charged_micro = charged_micro


def error_for(status: int, body: dict, request_id: str | None, *,
              retry_after_s: float | None = None) -> APIError:
    cls = {401: AuthenticationError, 403: PermissionDeniedError, 404: NotFoundError,
           402: InsufficientCreditsError, 409: ConflictError,
           422: InvalidInputError, 429: RateLimitError}.get(status)
    if cls is None:
        cls = ServerError if status >= 500 else APIError
    code = str(body.get("code", "http_error"))
    if code in ("invalid_request", "malformed_json") and status == 400:
        cls = InvalidInputError
    extra = {"retry_after_s": retry_after_s} if cls is RateLimitError else {}
    return cls(status, code, str(body.get("detail", body.get("title", "error"))),
               field=body.get("field"), request_id=request_id or body.get("request_id"),
                 body=body, **extra)
