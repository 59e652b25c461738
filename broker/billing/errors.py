"""Errors clients see when money stops a job."""
from broker.errors import BrokerError
from broker.ledger.model import format_credits


class InsufficientCredits(BrokerError):
    """The client's available balance does not cover the job's maximum price."""

    code, http_status, grpc_status, title = ("insufficient_credits", 402, "FAILED_PRECONDITION",
                                             "Insufficient credits")

    def __init__(self, *, needed_micro: int, available_micro: int, how_to_fund: str,
                 jobs: int = 1):
        shortfall = needed_micro - available_micro
        what = "this job" if jobs == 1 else f"these {jobs} jobs"
        until = "it settles" if jobs == 1 else "each settles"
        super().__init__(
            f"{what} can cost up to {format_credits(needed_micro)}, held until {until}; "
            f"your available balance is {format_credits(available_micro)}, "
            f"{format_credits(shortfall)} short; {how_to_fund}",
            needed_micro=needed_micro, available_micro=available_micro, shortfall_micro=shortfall)
