"""Errors of pricing (rendered as RFC 7807 problems by the app's one handler)."""
from broker.errors import BrokerError


class InvalidPrice(BrokerError):
    code, http_status, grpc_status, title = ("invalid_price", 422, "INVALID_ARGUMENT",
                                             "Invalid price")
