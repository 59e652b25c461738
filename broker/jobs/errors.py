"""Errors of the job lifecycle (client-facing and agent-facing)."""
from broker.errors import BrokerError, Conflict, NotFound


class JobNotFound(NotFound):
    code, title = "job_not_found", "Job not found"


class JobNotCancellable(Conflict):
    code, title = "job_not_cancellable", "Job can no longer be cancelled"


class OutputNotFound(NotFound):
    code, title = "output_not_found", "Output not found"


class OutputExpired(BrokerError):
    """The output existed, and retention deleted it (output_retention_s)."""
    code, http_status, grpc_status, title = ("output_expired", 410, "NOT_FOUND",
                                             "Output expired")


class ReceiptRefused(BrokerError):
    """A receipt, output or progress report an agent sent that must not be accepted."""

    code, http_status, grpc_status, title = ("receipt_refused", 400, "FAILED_PRECONDITION",
                                             "Receipt refused")

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class NoProvider(Conflict):
    """Nobody could run the job: no provider known to the broker serves its build."""

    code, title = "no_provider", "No provider serves this plugin"
