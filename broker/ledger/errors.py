"""Errors of the ledger. Each has a stable ``code``, an ``http_status`` and a ``grpc_status``
(the name of a ``grpc.StatusCode``, as a string so that the domain imports no grpc), and a
message that says what to do next. Every refused operation wrote nothing.

``LedgerError`` derives from the broker's root error, so the REST API renders it as an
RFC 7807 problem like every other domain error.
"""
from __future__ import annotations

from broker.errors import BrokerError
from broker.ledger.model import AccountId, AccountKind, HoldState, format_credits


class LedgerError(BrokerError):
    """Root of every ledger error."""

    code = "ledger_error"
    http_status = 500
    grpc_status = "INTERNAL"
    title = "Ledger error"

    def __init__(self, message: str, **extra):
        super().__init__(message, **extra)


class InvalidAmount(LedgerError):
    """An amount is not a positive int of micro-credits (or is out of range)."""

    code = "ledger.invalid_amount"
    http_status = 422
    grpc_status = "INVALID_ARGUMENT"

    def __init__(self, name: str, value: object, allowed: str):
        super().__init__(f"{name} is {value!r} ({type(value).__name__}); it must be {allowed}, "
                         "in integer micro-credits (1 credit = 1,000,000)")
        self.name = name
        self.value = value


class InvalidArgument(LedgerError):
    """Another argument is malformed (an empty id, an unknown kind, an over-long key...)."""

    code = "ledger.invalid_argument"
    http_status = 422
    grpc_status = "INVALID_ARGUMENT"


class UnknownAccount(LedgerError):
    code = "ledger.unknown_account"
    http_status = 404
    grpc_status = "NOT_FOUND"

    def __init__(self, account: AccountId):
        super().__init__(f"no ledger account {account}; open it first "
                         f"(LedgerService.open_{_party(account.kind)})")
        self.account = account


def _party(kind: AccountKind) -> str:
    if kind.is_platform:
        return "platform_accounts()"
    return kind.value.split("_", 1)[0] + "(owner)"


class UnknownHold(LedgerError):
    code = "ledger.unknown_hold"
    http_status = 404
    grpc_status = "NOT_FOUND"

    def __init__(self, hold_id: str):
        super().__init__(f"no hold {hold_id!r}; holds are created by LedgerService.hold()")
        self.hold_id = hold_id


class UnknownTransaction(LedgerError):
    code = "ledger.unknown_transaction"
    http_status = 404
    grpc_status = "NOT_FOUND"

    def __init__(self, transaction_id: str):
        super().__init__(f"no ledger transaction {transaction_id!r}")
        self.transaction_id = transaction_id


class InsufficientCredits(LedgerError):
    """Moving the amount would take an account below zero, which its kind forbids."""

    code = "ledger.insufficient_credits"
    http_status = 402
    grpc_status = "FAILED_PRECONDITION"

    def __init__(self, account: AccountId, *, needed_micro: int, available_micro: int):
        hint = ("buy credits at /v1/credits/checkout" if account.kind is AccountKind.CLIENT_AVAILABLE
                else "lower the amount")
        super().__init__(f"needs {format_credits(needed_micro)}; balance of {account} is "
                         f"{format_credits(available_micro)}; {hint}")
        self.account = account
        self.needed_micro = needed_micro
        self.available_micro = available_micro


class IdempotencyConflict(LedgerError):
    """The idempotency key was used before with another operation or other arguments."""

    code = "ledger.idempotency_conflict"
    http_status = 409
    grpc_status = "ALREADY_EXISTS"

    def __init__(self, key: str, operation: str):
        super().__init__(f"idempotency key {key!r} was already used for a different {operation} "
                         "request; send the original request unchanged, or use a new key")
        self.key = key
        self.operation = operation


class HoldAlreadyResolved(LedgerError):
    code = "ledger.hold_already_resolved"
    http_status = 409
    grpc_status = "FAILED_PRECONDITION"

    def __init__(self, hold_id: str, state: HoldState, wanted: str):
        super().__init__(f"cannot {wanted} hold {hold_id}: it is already {state.value} "
                         "(a hold resolves exactly once)")
        self.hold_id = hold_id
        self.state = state


class HoldExpired(LedgerError):
    code = "ledger.hold_expired"
    http_status = 409
    grpc_status = "FAILED_PRECONDITION"

    def __init__(self, hold_id: str):
        super().__init__(f"hold {hold_id} has expired and can no longer be posted; expire it "
                         "(its credits go back to the client) and place a new hold")
        self.hold_id = hold_id


class HoldNotExpired(LedgerError):
    code = "ledger.hold_not_expired"
    http_status = 409
    grpc_status = "FAILED_PRECONDITION"

    def __init__(self, hold_id: str, expires_at: object):
        super().__init__(f"hold {hold_id} expires at {expires_at}; void it to release it earlier")
        self.hold_id = hold_id


class NotRefundable(LedgerError):
    code = "ledger.not_refundable"
    http_status = 409
    grpc_status = "FAILED_PRECONDITION"


class AlreadyRefunded(NotRefundable):
    """The hold was refunded already (under another key): its client has the credits."""

    def __init__(self, hold_id: str, transaction_id: str):
        super().__init__(f"hold {hold_id} was already refunded by transaction {transaction_id}")
        self.hold_id, self.transaction_id = hold_id, transaction_id


class NotReversible(LedgerError):
    code = "ledger.not_reversible"
    http_status = 409
    grpc_status = "FAILED_PRECONDITION"


class PostsNotBatched(LedgerError):
    """``post_many`` wrote nothing: a key of the batch is taken or a hold of it is not
    postable; each post made alone says which (and a replay returns its transaction)."""

    code = "ledger.posts_not_batched"
    http_status = 409
    grpc_status = "ABORTED"


class LedgerBusy(LedgerError):
    """Concurrent writers kept conflicting; nothing was written, and retrying is safe."""

    code = "ledger.busy"
    http_status = 503
    grpc_status = "UNAVAILABLE"
