"""Wrappers that count what passes through a port, without the service behind it knowing:
bytes written to a blob store, transactions the ledger wrote."""
from __future__ import annotations

import os

_PROVIDER_EARNING = "provider_vesting"   # where a settled job's provider share lands
_PAID_OUT = "platform_payment_clearing"          # where a payout's credits go


class MeteredBlobStore:
    """A blob store that counts the bytes written to it as ``store`` (every other call
    passes through)."""

    def __init__(self, inner, metrics, store: str):
        self._inner = inner
        self._metrics = metrics
        self._store = store

    def put(self, data: bytes) -> str:
        key = self._inner.put(data)
        self._metrics.blob_written(self._store, len(data))
        return key

    def put_file(self, src, key: str) -> bool:
        size = os.path.getsize(src)
        stored = self._inner.put_file(src, key)
        if stored:
            self._metrics.blob_written(self._store, size)
        return stored

    def __getattr__(self, name):
        return getattr(self._inner, name)


_MOVES = ("deposit", "post", "post_shared", "void", "expire", "refund", "vest", "payout",
          "stake", "unstake", "slash", "reverse")


class MeteredLedger:
    """The ledger, counting each transaction a money-moving call returns by kind, the
    credits posted to providers and the credits paid out."""

    def __init__(self, ledger, metrics):
        self._ledger = ledger
        self._metrics = metrics

    def __getattr__(self, name):
        target = getattr(self._ledger, name)
        if name in _MOVES:
            def metered(*args, **kwargs):
                result = target(*args, **kwargs)
                self._count(result)
                return result
            return metered
        if name in ("expire_due", "post_many"):  # a list of transactions
            def counted_each(*args, **kwargs):
                results = target(*args, **kwargs)
                for txn in results:
                    self._count(txn)
                return results
            return counted_each
        if name == "hold":
            def hold(*args, **kwargs):
                result = target(*args, **kwargs)
                self._metrics.ledger_transaction("hold")
                return result
            return hold
        return target

    def _count(self, txn) -> None:
        if txn is None or not hasattr(txn, "entries"):
            return
        kind = getattr(txn.kind, "value", str(txn.kind))
        earned = paid = 0
        for e in txn.entries:
            account_kind = getattr(e.account.kind, "value", "")
            if kind == "post" and account_kind == _PROVIDER_EARNING and e.amount_micro > 0:
                earned += e.amount_micro
            elif kind == "payout" and account_kind == _PAID_OUT and e.amount_micro > 0:
                paid += e.amount_micro
        self._metrics.ledger_transaction(kind, provider_micro=earned, paid_micro=paid)
