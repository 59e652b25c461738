"""Errors of payments."""
from broker.errors import BrokerError, Conflict, InvalidRequest


class FundingNotConfigured(BrokerError):
    code, http_status, grpc_status, title = ("payments_not_configured", 409, "FAILED_PRECONDITION",
                                             "Payments not configured")


class NotDevFunding(Conflict):
    code, title = "not_dev_funding", "Grants need the dev funding backend"


class WebhookRefused(BrokerError):
    code, http_status, grpc_status, title = ("webhook_refused", 400, "INVALID_ARGUMENT",
                                             "Webhook refused")


class InvalidPaymentAmount(InvalidRequest):
    code, title = "invalid_amount", "Invalid amount"


class PayoutAccountMissing(Conflict):
    code, title = "payout_account_missing", "No payout account"


class PaymentProviderError(BrokerError):
    """Stripe refused or failed a call; nothing was charged or paid."""

    code, http_status, grpc_status, title = ("payment_provider_error", 502, "UNAVAILABLE",
                                             "Payment provider error")
