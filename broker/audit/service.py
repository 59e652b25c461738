"""AuditLog: appends hash-chained entries and verifies the chain.

Appends are serialised: in-process by a lock, across broker replicas by the unique
``seq`` (a writer that lost the race gets :class:`SeqTaken` from the repository and
retries on the new head).

An append costs one INSERT: the log keeps the head it last wrote in memory (nothing else
in this process appends behind the lock), and a stale head — another replica appended —
shows up as :class:`SeqTaken` on the next append, which then re-reads the head and retries.
An idempotent replay (an entry with the same ``ref`` exists) also shows up as
:class:`SeqTaken`, from the unique ``ref``; only then is the ref looked up.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Iterator, Protocol

from broker.audit.model import GENESIS, AuditEntry, ChainReport

log = logging.getLogger(__name__)


class SeqTaken(Exception):
    """Another writer appended entry ``seq`` first."""


class AuditRepository(Protocol):
    def head(self) -> AuditEntry | None: ...
    def add(self, entry: AuditEntry) -> None:
        """Insert ``entry``; raise :class:`SeqTaken` when its seq exists, or its ref."""
    def has_ref(self, ref: str) -> bool: ...
    def scan(self, batch: int = 1000) -> Iterator[AuditEntry]:
        """Every entry in seq order."""
    def search(self, *, subject: str | None = None, action: str | None = None,
               before_seq: int | None = None, limit: int = 100) -> list[AuditEntry]:
        """Newest first; ``subject`` matches exactly or as a prefix ending in '*'."""


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    """Data as canonical JSON can encode it (no floats that are not finite, str keys)."""
    return json.loads(json.dumps(data, default=str, allow_nan=False))


class AuditLog:
    def __init__(self, repo: AuditRepository, clock=time.time):
        self.repo = repo
        self.clock = clock
        self._lock = threading.Lock()
        # The last entry this process appended (or read as the head); None: read it first.
        self._head: AuditEntry | None = None
        self._head_known = False

    def record(self, actor: str, action: str, subject: str, data: dict[str, Any] | None = None,
               *, ref: str | None = None) -> AuditEntry | None:
        """Append an entry; with ``ref``, nothing when an entry with that ref exists (an
        idempotent replay of the same money movement). Returns the entry written."""
        body = _jsonable(data or {})
        with self._lock:
            for _ in range(20):
                if not self._head_known:
                    self._head, self._head_known = self.repo.head(), True
                head = self._head
                entry = AuditEntry(seq=(head.seq + 1) if head else 1,
                                   at_ms=int(self.clock() * 1000), actor=actor, action=action,
                                   subject=subject, data=body, ref=ref,
                                   prev_hash=head.hash if head else GENESIS)
                entry = AuditEntry(**{**entry.__dict__, "hash": entry.compute_hash()})
                try:
                    self.repo.add(entry)
                except SeqTaken:
                    # Another replica appended (our head is stale), or this ref is already
                    # in the log (an idempotent replay: nothing to write).
                    self._head_known = False
                    if ref is not None and self.repo.has_ref(ref):
                        return None
                    continue
                except BaseException:
                    self._head_known = False  # the insert may or may not have landed
                    raise
                self._head = entry
                return entry
        raise RuntimeError("could not append to the audit log: 20 collisions in a row")

    def safe_record(self, *args, **kwargs) -> AuditEntry | None:
        """:meth:`record` for hooks after an effect already committed: a failure is logged,
        never raised into the money path."""
        try:
            return self.record(*args, **kwargs)
        except Exception:  # noqa: BLE001
            log.exception("AUDIT LOG WRITE FAILED for %s %s", args[1:2], args[2:3])
            return None

    def verify(self) -> ChainReport:
        """Walk the chain from the first entry; stop at the first broken link."""
        prev, expected_seq, checked = GENESIS, 1, 0
        for entry in self.repo.scan():
            if entry.seq != expected_seq:
                return ChainReport(checked, False, expected_seq,
                                   f"entry #{expected_seq} is missing (next found is #{entry.seq})",
                                   prev)
            if entry.prev_hash != prev:
                return ChainReport(checked, False, entry.seq,
                                   f"entry #{entry.seq} points at previous hash "
                                   f"{entry.prev_hash[:12]}…, but entry #{entry.seq - 1} hashes to "
                                   f"{prev[:12]}…", prev)
            actual = entry.compute_hash()
            if actual != entry.hash:
                return ChainReport(checked, False, entry.seq,
                                   f"entry #{entry.seq} was changed after it was written: its "
                                   f"content hashes to {actual[:12]}…, the chain recorded "
                                   f"{entry.hash[:12]}…", prev)
            prev, expected_seq, checked = entry.hash, expected_seq + 1, checked + 1
        return ChainReport(checked, True, head_hash=prev)

    def search(self, **kwargs) -> list[AuditEntry]:
        return self.repo.search(**kwargs)


class InMemoryAuditRepository:
    def __init__(self):
        self.entries: list[AuditEntry] = []

    def head(self):
        return self.entries[-1] if self.entries else None

    def add(self, entry):
        # Like the SQL table: seq and ref are unique.
        if any(e.seq == entry.seq or (entry.ref is not None and e.ref == entry.ref)
               for e in self.entries):
            raise SeqTaken(entry.seq)
        self.entries.append(entry)

    def has_ref(self, ref):
        return any(e.ref == ref for e in self.entries)

    def scan(self, batch=1000):
        yield from sorted(self.entries, key=lambda e: e.seq)

    def search(self, *, subject=None, action=None, before_seq=None, limit=100):
        out = []
        for e in sorted(self.entries, key=lambda e: -e.seq):
            if subject and not (e.subject == subject or (subject.endswith("*") and
                                                         e.subject.startswith(subject[:-1]))):
                continue
            if action and not e.action.startswith(action):
                continue
            if before_seq is not None and e.seq >= before_seq:
                continue
            out.append(e)
            if len(out) >= limit:
                break
        return out
