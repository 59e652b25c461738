"""AuditLog: appends hash-chained entries and verifies the chain.

An entry is written in the transaction of what it records: ``record`` inside an
``atomic`` block (a job's hold, a settlement's ledger post) defers the entry to the end of
that block's transaction, so the entry commits with the money movement or not at all, and
costs one INSERT in a COMMIT that happens anyway. Outside such a block it opens a
transaction of its own.

Appends are serialised: in-process by a lock, taken just before COMMIT and held until it
is done (the log keeps the head it last wrote in memory, and only a committed entry
becomes the head); across broker replicas by the unique ``seq``. An insert that finds its
seq taken (another replica appended: the head is stale) or its ``ref`` taken (an
idempotent replay of a movement already recorded) writes nothing; the log then re-reads
the head in the same transaction and appends after it, or skips the replay.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, ContextManager, Iterator, Protocol

from sdk.protocol.canonical import canonical_text

from broker.audit.model import GENESIS, AuditEntry, ChainReport, plain_data

log = logging.getLogger(__name__)


class AuditRepository(Protocol):
    def transaction(self) -> ContextManager[Any]:
        """The caller's open transaction (``broker.storage.base.atomic``), else a new one:
        an object with ``conn``, ``defer``, ``after_commit`` and ``after_rollback``."""
    def head(self, conn=None) -> AuditEntry | None: ...
    def append(self, conn, entry: AuditEntry, data_json: str) -> bool:
        """Insert ``entry``, whose data is ``data_json`` as canonical JSON (as hashed);
        False, writing nothing, when its seq or its ref exists."""
    def append_many(self, conn, entries: list[AuditEntry], data_jsons: list[str]) -> bool:
        """Insert every entry (``data_jsons``: each one's data, as for ``append``), or none
        of them: False, writing nothing, when the seq or ref of one exists."""
    def has_ref(self, ref: str, conn=None) -> bool: ...
    def scan(self, batch: int = 1000) -> Iterator[AuditEntry]:
        """Every entry in seq order."""
    def search(self, *, subject: str | None = None, action: str | None = None,
               before_seq: int | None = None, limit: int = 100) -> list[AuditEntry]:
        """Newest first; ``subject`` matches exactly or as a prefix ending in '*'."""


class _Pending:
    __slots__ = ("actor", "action", "subject", "data", "data_json", "ref", "at_ms", "entry")

    def __init__(self, actor, action, subject, data, ref, at_ms):
        self.actor, self.action, self.subject = actor, action, subject
        # Normalised and encoded once for the stored row (the hash encodes the whole entry).
        self.data = plain_data(data)
        self.data_json = canonical_text(self.data)
        self.ref, self.at_ms = ref, at_ms
        self.entry: AuditEntry | None = None


class AuditLog:
    def __init__(self, repo: AuditRepository, clock=time.time):
        self.repo = repo
        self.clock = clock
        self._lock = threading.Lock()
        # The last entry this process committed (or read as the head); None: read it first.
        self._head: AuditEntry | None = None
        self._head_known = False
        self._epoch = 0  # the writer's rollbacks the head has seen (Tx.epoch, before_commit)

    def record(self, actor: str, action: str, subject: str, data: dict[str, Any] | None = None,
               *, ref: str | None = None) -> AuditEntry | None:
        """Append an entry; with ``ref``, nothing when an entry with that ref exists (an
        idempotent replay of the same money movement). Returns the entry written; None for
        a replay, and inside an ``atomic`` block, whose commit writes it."""
        item = _Pending(actor, action, subject, data or {}, ref, int(self.clock() * 1000))
        with self.repo.transaction() as tx:
            tx.defer(self, item)
        return item.entry

    def before_commit(self, tx, items: list[_Pending]) -> None:
        """Append ``items`` in ``tx``, just before its COMMIT; the lock is held until the
        commit is done, and the head moves only if it succeeds. In a grouped transaction
        (SQLite's group commit: one transaction at a time, the next one may begin before
        this one commits, see broker.storage.base._Writer) the head moves at once, as the
        next transaction must chain to it, and the lock is not held past this call (the
        next one's append waits for it): a rollback bumps the next one's ``tx.epoch``,
        and the head is read again."""
        if getattr(tx, "grouped", False):
            with self._lock:
                if self._epoch != tx.epoch:
                    self._head_known, self._epoch = False, tx.epoch
                head, known = self._append(tx, items, self._head, self._head_known)
                self._head, self._head_known = head, known

            def rolled_back():
                for item in items:
                    item.entry = None
            tx.after_rollback(rolled_back)
            return
        self._lock.acquire()
        try:
            head, known = self._append(tx, items, self._head, self._head_known)
        except BaseException:
            self._head_known = False
            self._lock.release()
            raise

        def committed():
            self._head, self._head_known = head, known
            self._lock.release()

        def rolled_back():
            self._head_known = False
            for item in items:
                item.entry = None
            self._lock.release()
        tx.after_commit(committed)
        tx.after_rollback(rolled_back)

    def _append(self, tx, items: list[_Pending], head: AuditEntry | None,
                known: bool) -> tuple[AuditEntry | None, bool]:
        """Append ``items`` after ``head`` in ``tx``; the new head. Raises having marked
        the head unknown (a failed append may have been after another replica's)."""
        try:
            if len(items) > 1:  # (a batch's settlements) all in one statement if it can
                if not known:
                    head, known = self.repo.head(tx.conn), True
                entries = []
                for item in items:
                    seq, prev = (head.seq + 1, head.hash) if head else (1, GENESIS)
                    head = self._chained(item, seq, prev)
                    entries.append(head)
                if self.repo.append_many(tx.conn, entries, [i.data_json for i in items]):
                    for item, entry in zip(items, entries):
                        item.entry = entry
                    return head, True
                # A seq taken (another replica appended) or a ref (a replay): nothing was
                # written; one at a time, as below, says which.
                head, known = None, False
            for item in items:
                for _ in range(20):
                    if not known:
                        head, known = self.repo.head(tx.conn), True
                    seq, prev = (head.seq + 1, head.hash) if head else (1, GENESIS)
                    entry = self._chained(item, seq, prev)
                    if self.repo.append(tx.conn, entry, item.data_json):
                        head, item.entry = entry, entry
                        break
                    # Another replica appended (our head is stale), or this ref is already
                    # in the log (an idempotent replay: nothing to write).
                    known = False
                    if item.ref is not None and self.repo.has_ref(item.ref, tx.conn):
                        break
                else:
                    raise RuntimeError("could not append to the audit log: 20 collisions "
                                       "in a row")
        except BaseException:
            self._head_known = False
            raise
        return head, known

    @staticmethod
    def _chained(item: _Pending, seq: int, prev: str) -> AuditEntry:
        """``item`` as the entry at ``seq`` after the one whose hash is ``prev``."""
        entry = AuditEntry(seq=seq, at_ms=item.at_ms, actor=item.actor, action=item.action,
                           subject=item.subject, data=item.data, ref=item.ref, prev_hash=prev)
        return replace(entry, hash=entry.compute_hash())

    def safe_record(self, *args, **kwargs) -> AuditEntry | None:
        """:meth:`record` for what must not fail because the audit log did (a console
        login): a failure is logged, never raised. Inside an ``atomic`` block the entry is
        written at its commit, and a failure there fails the whole transaction."""
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
            if not entry.hashes_as_written():
                actual = entry.compute_hash()
                return ChainReport(checked, False, entry.seq,
                                   f"entry #{entry.seq} was changed after it was written: its "
                                   f"content hashes to {actual[:12]}…, the chain recorded "
                                   f"{entry.hash[:12]}…", prev)
            prev, expected_seq, checked = entry.hash, expected_seq + 1, checked + 1
        return ChainReport(checked, True, head_hash=prev)

    def search(self, **kwargs) -> list[AuditEntry]:
        return self.repo.search(**kwargs)


class _MemoryTx:
    """What ``atomic`` gives, for the in-memory repository: deferred work runs at exit."""

    conn = None

    def __init__(self):
        self._deferred, self._after_commit, self._after_rollback = [], [], []

    def defer(self, owner, item):
        self._deferred.append((owner, item))

    def after_commit(self, fn):
        self._after_commit.append(fn)

    def after_rollback(self, fn):
        self._after_rollback.append(fn)


class InMemoryAuditRepository:
    def __init__(self):
        self.entries: list[AuditEntry] = []

    @contextmanager
    def transaction(self):
        tx = _MemoryTx()
        yield tx
        for owner, item in tx._deferred:
            owner.before_commit(tx, [item])
        for fn in tx._after_commit:
            fn()

    def head(self, conn=None):
        return self.entries[-1] if self.entries else None

    def append(self, conn, entry, data_json):
        # Like the SQL table: seq and ref are unique.
        if any(e.seq == entry.seq or (entry.ref is not None and e.ref == entry.ref)
               for e in self.entries):
            return False
        self.entries.append(entry)
        return True

    def append_many(self, conn, entries, data_jsons):
        taken = {e.seq for e in self.entries}, {e.ref for e in self.entries if e.ref}
        if any(e.seq in taken[0] or e.ref in taken[1] for e in entries):
            return False
        self.entries.extend(entries)
        return True

    def has_ref(self, ref, conn=None):
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
