"""Audits every money movement by wrapping the ledger: each call that writes a ledger
transaction appends an audit entry whose ``ref`` is the transaction id, so an idempotent
replay (same key, same transaction) is audited once.

The entry is written in the ledger operation's own database transaction (the call runs in
the audit repository's ``transaction()``, which the ledger's unit of work joins), so a
ledger transaction and its entry commit together or not at all; a caller's enclosing
``atomic`` block (a job's submit, a settlement) makes that one transaction for all three.
"""
from __future__ import annotations

from typing import Any

from broker.audit.service import AuditLog

_MOVES = ("deposit", "hold", "post", "post_shared", "void", "expire", "refund", "vest",
          "payout", "stake", "unstake", "slash", "reverse")
# Calls that return several transactions, and the operation each one is.
_MANY = {"expire_due": "expire", "post_many": "post"}


def _txn_data(txn) -> dict[str, Any]:
    return {"transaction": txn.id, "kind": getattr(txn.kind, "value", str(txn.kind)),
            "memo": txn.memo, "hold": txn.hold_id,
            "entries": [{"account": f"{e.account.kind.value}:{e.account.owner}",
                         "amount_micro": e.amount_micro} for e in txn.entries]}


class AuditedLedger:
    """The ledger, with every money-moving call audited. Everything else passes through."""

    def __init__(self, ledger, audit: AuditLog):
        self._ledger = ledger
        self._audit = audit

    def __getattr__(self, name):
        target = getattr(self._ledger, name)
        if name in _MOVES:
            def audited(*args, **kwargs):
                with self._audit.repo.transaction():
                    result = target(*args, **kwargs)
                    self._record(name, result)
                return result
            return audited
        if name in _MANY:  # a list of transactions: each audited as its operation's
            def audited_each(*args, **kwargs):
                with self._audit.repo.transaction():
                    results = target(*args, **kwargs)
                    for txn in results:
                        self._record(_MANY[name], txn)
                return results
            return audited_each
        return target

    def _record(self, operation: str, result) -> None:
        if result is None:
            return
        if hasattr(result, "entries"):  # a Transaction
            subject = f"hold:{result.hold_id}" if result.hold_id else f"transaction:{result.id}"
            self._audit.record("ledger", f"ledger.{operation}", subject, _txn_data(result),
                               ref=f"txn:{result.id}")
        elif hasattr(result, "hold_transaction_id"):  # a Hold
            self._audit.record("ledger", "ledger.hold", f"job:{result.job_id}",
                               {"hold": result.id, "client": result.client,
                                "amount_micro": result.amount_micro,
                                "transaction": result.hold_transaction_id},
                               ref=f"txn:{result.hold_transaction_id}")
