"""An audit entry and the hash that chains it to the one before.

``hash = sha256(prev_hash || canonical_bytes(document))`` where the document is every
field of the entry except the two hashes. Editing, deleting or reordering any entry breaks
the link at that entry (its stored hash no longer matches) or at the next one (its
``prev_hash`` no longer matches).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from sdk.protocol.canonical import canonical_bytes, legacy_bytes

GENESIS = "0" * 64  # prev_hash of the first entry


@dataclass(frozen=True)
class AuditEntry:
    seq: int                 # 1, 2, 3… with no gaps
    at_ms: int               # epoch milliseconds
    actor: str               # "admin:<account>", "system", "billing", …
    action: str              # "pricing.set", "provider.pause", "ledger.post", …
    subject: str             # what it is about: "plugin:echo", "provider:<id>", "job:<id>"
    data: dict[str, Any] = field(default_factory=dict)  # before/after, reason, amounts
    ref: str | None = None   # a unique reference (a ledger transaction id) for deduplication
    prev_hash: str = GENESIS
    hash: str = ""

    def document(self) -> dict[str, Any]:
        return {"seq": self.seq, "at_ms": self.at_ms, "actor": self.actor, "action": self.action,
                "subject": self.subject, "data": self.data, "ref": self.ref}

    def compute_hash(self) -> str:
        return chain_hash(self.prev_hash, self.document())

    def hashes_as_written(self) -> bool:
        """Whether the entry's content gives its stored hash: under canonical JSON (JCS),
        or, for an entry written before canonical JSON became JCS, the encoding of then
        (the two differ only on floats such as 1.0 and on rare keys)."""
        if self.compute_hash() == self.hash:
            return True
        return hashlib.sha256(self.prev_hash.encode("ascii")
                              + legacy_bytes(self.document())).hexdigest() == self.hash


def chain_hash(prev_hash: str, document: dict[str, Any]) -> str:
    return hashlib.sha256(prev_hash.encode("ascii") + canonical_bytes(document)).hexdigest()


# Built once (``json.dumps`` with options builds an encoder per call).
_PLAIN_JSON = json.JSONEncoder(default=str, allow_nan=False).encode


def plain_data(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` as canonical JSON can encode it: string keys, finite numbers, anything else
    as its ``str``."""
    return json.loads(_PLAIN_JSON(data))


@dataclass(frozen=True)
class ChainReport:
    """The result of walking the chain: ``ok`` or the first broken link and why."""

    checked: int
    ok: bool
    broken_seq: int | None = None
    problem: str = ""
    head_hash: str = GENESIS
