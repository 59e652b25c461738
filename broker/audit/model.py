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
from json.encoder import encode_basestring
from typing import Any

from sdk.protocol.canonical import canonical_bytes

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


def chain_hash(prev_hash: str, document: dict[str, Any]) -> str:
    return hashlib.sha256(prev_hash.encode("ascii") + canonical_bytes(document)).hexdigest()


# Built once (``json.dumps`` with options builds an encoder per call). _CANONICAL_JSON
# encodes as canonical_bytes does, less its check, which plain data always passes.
_PLAIN_JSON = json.JSONEncoder(default=str, allow_nan=False).encode
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                                   allow_nan=False).encode


def plain_data(data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``data`` as canonical JSON can encode it (string keys, finite numbers, anything else
    as its ``str``), and its canonical JSON text: what an entry stores and hashes, encoded
    once here instead of again for the hash and for the stored row."""
    value = json.loads(_PLAIN_JSON(data))
    return value, _CANONICAL_JSON(value)


def entry_hash(prev_hash: str, *, seq: int, at_ms: int, actor: str, action: str, subject: str,
               ref: str | None, data_json: str) -> str:
    """``chain_hash(prev_hash, document)`` of the entry with these fields, whose data is
    ``data_json`` (from :func:`plain_data`): the document's canonical bytes are put together
    around that text (keys in code point order, strings as canonical JSON writes them)
    rather than encoding the data again. :meth:`AuditEntry.compute_hash`, which
    verification uses, encodes the whole document and must agree."""
    if not (type(seq) is int and type(at_ms) is int and type(actor) is str
            and type(action) is str and type(subject) is str
            and (ref is None or type(ref) is str)):
        return chain_hash(prev_hash, {"seq": seq, "at_ms": at_ms, "actor": actor,
                                      "action": action, "subject": subject,
                                      "data": json.loads(data_json), "ref": ref})
    document = (f'{{"action":{encode_basestring(action)},"actor":{encode_basestring(actor)},'
                f'"at_ms":{at_ms},"data":{data_json},'
                f'"ref":{"null" if ref is None else encode_basestring(ref)},"seq":{seq},'
                f'"subject":{encode_basestring(subject)}}}')
    return hashlib.sha256(prev_hash.encode("ascii") + document.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class ChainReport:
    """The result of walking the chain: ``ok`` or the first broken link and why."""

    checked: int
    ok: bool
    broken_seq: int | None = None
    problem: str = ""
    head_hash: str = GENESIS
