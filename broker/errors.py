"""The root of every error the broker shows to a client or an agent.

Each error carries a stable ``code`` (clients branch on it), an HTTP status for the REST
API (rendered as RFC 7807 problem JSON by one handler) and a gRPC status name for the agent
gateway. Messages say what was wrong and what to do next.
"""
from __future__ import annotations

from typing import Any


class BrokerError(Exception):
    code = "broker_error"
    http_status = 500
    grpc_status = "INTERNAL"
    title = "Broker error"

    def __init__(self, message: str, *, field: str | None = None,
                 code_override: str | None = None, **extra: Any):
        super().__init__(message)
        self.message = message
        self.field = field
        self.extra = extra
        if code_override:
            self.code = code_override

    def problem(self) -> dict[str, Any]:
        body = {"type": f"https://sparecycles.dev/errors/{self.code}", "title": self.title,
                "status": self.http_status, "code": self.code, "detail": self.message}
        if self.field is not None:
            body["field"] = self.field
        body.update(self.extra)
        return body


def in_item(exc: BrokerError, index: int, name: str = "jobs") -> BrokerError:
    """``exc`` as the error of item ``index`` of the request's list ``name`` (a bulk
    submit's ``jobs``): its message begins with the item (``jobs[3]: ...``), its field is
    the item's (``jobs[3].inputs.text``), and the problem carries ``index``."""
    where = f"{name}[{index}]"
    exc.message = f"{where}: {exc.message}"
    exc.args = (exc.message,)
    exc.field = f"{where}.{exc.field}" if exc.field else where
    exc.extra["index"] = index
    return exc


class InvalidRequest(BrokerError):
    code, http_status, grpc_status, title = ("invalid_request", 400, "INVALID_ARGUMENT",
                                             "Invalid request")


class InvalidInput(BrokerError):
    code, http_status, grpc_status, title = ("invalid_input", 422, "INVALID_ARGUMENT",
                                             "Invalid input")


class Unauthenticated(BrokerError):
    code, http_status, grpc_status, title = ("unauthenticated", 401, "UNAUTHENTICATED",
                                             "Authentication required")


class Forbidden(BrokerError):
    code, http_status, grpc_status, title = ("forbidden", 403, "PERMISSION_DENIED", "Forbidden")


class NotFound(BrokerError):
    code, http_status, grpc_status, title = ("not_found", 404, "NOT_FOUND", "Not found")


class UnknownPlugin(NotFound):
    code, title = "unknown_plugin", "Unknown plugin"


class Conflict(BrokerError):
    code, http_status, grpc_status, title = ("conflict", 409, "FAILED_PRECONDITION", "Conflict")


class IdempotencyConflict(Conflict):
    code, title = "idempotency_conflict", "Idempotency key reused with another request"


class NotReady(BrokerError):
    code, http_status, grpc_status, title = ("not_ready", 503, "UNAVAILABLE", "Not ready")


class PayloadTooLarge(BrokerError):
    code, http_status, grpc_status, title = ("payload_too_large", 413, "RESOURCE_EXHAUSTED",
                                             "Payload too large")


class ReplicaFull(BrokerError):
    """This broker replica holds as many connections (agent streams, waiting clients,
    requests in its thread pool) as its limits allow; another replica, or this one a moment
    later, can take the request. HTTP answers carry ``Retry-After``."""
    code, http_status, grpc_status, title = ("replica_full", 503, "RESOURCE_EXHAUSTED",
                                             "Replica full")
