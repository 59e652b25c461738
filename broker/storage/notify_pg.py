"""PgNotifyBus: the replicas' wake-ups as PostgreSQL ``LISTEN/NOTIFY`` (psycopg 3).

No new service: the database the replicas share carries them. Each replica holds two
connections of its own outside the engine's pool: one listens (``LISTEN sparecycles``), one
sends. Publishing never blocks the caller: messages go into a queue that a sender thread
drains, packing whatever piled up meanwhile into as few ``pg_notify`` calls as fit
PostgreSQL's 8,000-byte payload (under load, one call carries many wake-ups; idle, a
message leaves at once). A notification is delivered to listeners only once the statement
that sent it commits, and the sender runs in autocommit after the caller's own commit, so a
replica that wakes always finds the rows that caused it.

PostgreSQL delivers every notification to every listening connection, the sender's own
replica included: each payload carries the sender's replica id and a replica ignores its
own. When the listening connection drops, notifications sent meanwhile are lost to this
replica; once it listens again the ``on_gap`` handlers run (waiters re-read their jobs, the
dispatcher re-reads the queue), so nothing waits for a wake-up that will never come.

Sealed (``cipher``: the broker's at-rest key, which replicas share): a payload carries job
data (a queued job whole, an ended job's copy), and PostgreSQL may log it and any role
allowed to ``LISTEN`` reads it, so each payload is ``{"r": sender, "s": base64 of the
sealed plaintext payload}`` (the sender inside too, compared on opening). One that does not
open (another key, altered, forged in plaintext) is dropped, logged, and taken for what
may have been missed: the ``on_gap`` handlers run, so the replica catches up from the rows.
Those catch-ups are coalesced: at most one every ``CATCH_UP_EVERY_S``, and one more after
the last payload that did not open, so a flood of junk from any role that may ``NOTIFY``
costs a few catch-ups a second (each wakes every waiting client and rescans the queue),
not one per payload, while a wake-up that was really missed is caught up within that
interval.
Sealing and base64 leave about 5,800 bytes of plaintext per notification; a message larger
than a notification goes without its ``c`` (the copy it carries, which the receivers can
read from the rows instead), and one still too large is dropped (logged), as before.
"""
from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy.engine import make_url

from broker.replicas.bus import Handler, new_replica_id
from broker.storage.sealed import SEAL_OVERHEAD, AtRestCipher, AtRestError

log = logging.getLogger(__name__)

CHANNEL = "sparecycles"
MAX_PAYLOAD = 7_800   # bytes of JSON per notification (PostgreSQL's limit is 8,000)
RETRY_S = (0.2, 0.5, 1.0, 2.0, 5.0)
UNOPENED_LOG_EVERY_S = 10.0  # a stream of payloads that do not open is logged this often
CATCH_UP_EVERY_S = 0.5  # payloads that do not open catch up at most this often (and once after)


def conninfo_of(db_url: str) -> str:
    """A libpq URI for psycopg from the broker's SQLAlchemy URL
    (``postgresql+psycopg://…`` → ``postgresql://…``)."""
    url = make_url(db_url)
    if not url.drivername.startswith("postgresql"):
        raise ValueError(f"LISTEN/NOTIFY needs PostgreSQL; the database URL is {url.drivername}")
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


class PgNotifyBus:
    """See the module docstring. ``replica_id`` names this process in every payload."""

    shared = True

    def __init__(self, db_url: str, *, replica_id: str | None = None, channel: str = CHANNEL,
                 cipher: AtRestCipher | None = None):
        self.conninfo = conninfo_of(db_url)
        self.replica_id = replica_id or new_replica_id()
        self.channel = channel
        self.cipher = cipher
        self._head = f'{{"r":{json.dumps(self.replica_id)},"m":['
        shell = len(json.dumps({"r": self.replica_id, "s": ""}, separators=(",", ":")))
        #: bytes of plaintext payload per notification (less when sealed: nonce, MAC, base64)
        self.budget = (MAX_PAYLOAD if cipher is None
                       else (MAX_PAYLOAD - shell) // 4 * 3 - SEAL_OVERHEAD)
        self._handlers: dict[str, list[Handler]] = {}
        self._gap: list[Callable[[], None]] = []
        self._out: deque[tuple[str, dict]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._listen_conn: psycopg.Connection | None = None
        self.pool_size = 4
        self._idle: list[psycopg.Connection] = []  # for publishing from callers' threads
        self._threads: list[threading.Thread] = []
        self.sent = 0        # notifications sent (each may carry several messages)
        self.received = 0    # messages handled from other replicas
        self.unopened = 0    # payloads that did not open (another key, altered, plaintext)
        self._unopened_logged = (float("-inf"), 0)  # (when, how many then)
        # The listening thread's catch-ups: when the last ran (monotonic), and whether
        # a payload that did not open came since (one more is due).
        self._caught_up_at = float("-inf")
        self._catch_up_due = False

    # ---- the port ----------------------------------------------------------------------
    def subscribe(self, kind: str, handler: Handler) -> None:
        self._handlers.setdefault(kind, []).append(handler)

    def on_gap(self, handler: Callable[[], None]) -> None:
        self._gap.append(handler)

    def publish(self, kind: str, data: dict[str, Any], urgent: bool = True) -> None:
        """``urgent``: sent from the caller's thread on an idle connection of the bus's own
        small pool (one round trip, no thread hop: the wake-up leaves at once); when every
        such connection is busy, and for what is not urgent, queued for the sender
        thread, which packs what piles up."""
        with self._cond:
            if self._closed or not self._threads:
                return  # not started (a command-line tool) or closed: nobody to tell
            conn = self._idle.pop() if urgent and self._idle and not self._out else None
            if conn is None:
                self._out.append((kind, data))
                self._cond.notify()
                return
        try:
            for payload in self._pack([(kind, data)]):  # none: too large (logged)
                conn.execute("SELECT pg_notify(%s, %s)", (self.channel, payload))
                self.sent += 1
        except Exception:  # noqa: BLE001 - that connection is gone: the sender thread retries
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass
            with self._cond:
                self._out.append((kind, data))
                self._cond.notify()
            return
        with self._cond:
            if len(self._idle) < self.pool_size and not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def start(self) -> None:
        """Listen before returning (what other replicas send from now on reaches us), then
        start the listening and sending threads."""
        if self._threads:
            return
        self._listen_conn = self._listen()
        self._idle = [psycopg.connect(self.conninfo, autocommit=True)
                      for _ in range(self.pool_size)]
        self._closed = False
        for target, name in ((self._listen_loop, "bus-listen"), (self._send_loop, "bus-send")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info("replica %s listens for other replicas on channel %r", self.replica_id,
                 self.channel)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            idle, self._idle = self._idle, []
        for c in idle:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        conn = self._listen_conn
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        for t in self._threads:
            t.join(timeout=3)
        self._threads = []

    # ---- listening -----------------------------------------------------------------
    def _listen(self) -> psycopg.Connection:
        conn = psycopg.connect(self.conninfo, autocommit=True,
                               application_name=f"sparecycles-bus {self.replica_id}"[:63])
        conn.execute(f'LISTEN "{self.channel}"')
        return conn

    def _listen_loop(self) -> None:
        failures = 0
        while not self._closed:
            conn = self._listen_conn
            try:
                if conn is None or conn.closed:
                    conn = self._listen_conn = self._listen()
                    log.info("replica %s listens again; catching up from the rows",
                             self.replica_id)
                    self._caught_up()
                failures = 0
                for note in conn.notifies(timeout=self._listen_timeout()):
                    self._dispatch(note.payload)
                    if self._closed:
                        return
                    self._catch_up_if_due()
                self._catch_up_if_due()
            except Exception as exc:  # noqa: BLE001 - the database went away: retry
                if self._closed:
                    return
                wait = RETRY_S[min(failures, len(RETRY_S) - 1)]
                failures += 1
                log.warning("replica %s lost its LISTEN connection (%s); retrying in %gs",
                            self.replica_id, exc, wait)
                try:
                    if conn is not None:
                        conn.close()
                except Exception:  # noqa: BLE001
                    pass
                self._listen_conn = None
                time.sleep(wait)

    def _listen_timeout(self) -> float:
        """How long to wait for notifications: until a due catch-up may run, else 1 s."""
        if not self._catch_up_due:
            return 1.0
        return min(1.0, max(0.0, self._caught_up_at + CATCH_UP_EVERY_S - time.monotonic()))

    def _catch_up_soon(self) -> None:
        """Catch up now unless one ran within ``CATCH_UP_EVERY_S``; then once it has passed
        (the listening loop runs it: :meth:`_catch_up_if_due`)."""
        self._catch_up_due = True
        self._catch_up_if_due()

    def _catch_up_if_due(self) -> None:
        if (self._catch_up_due
                and time.monotonic() - self._caught_up_at >= CATCH_UP_EVERY_S):
            self._caught_up()

    def _caught_up(self) -> None:
        self._catch_up_due = False
        self._caught_up_at = time.monotonic()
        for handler in self._gap:
            try:
                handler()
            except Exception:  # noqa: BLE001 - one catch-up must not stop the others
                log.exception("catch-up handler %r failed", handler)

    def _dispatch(self, payload: str) -> None:
        try:
            doc = json.loads(payload)
        except ValueError:
            self._unopened("not JSON", payload)
            return
        if not isinstance(doc, dict) or doc.get("r") == self.replica_id:
            return
        doc = self._open(doc, payload)
        if doc is None:
            return
        for kind, data in doc.get("m") or ():
            for handler in self._handlers.get(kind, ()):
                try:
                    handler(data)
                except Exception:  # noqa: BLE001 - a bad message must not stop listening
                    log.exception("handling %s from replica %s failed", kind, doc.get("r"))
            self.received += 1

    def _open(self, doc: dict, payload: str) -> dict | None:
        """The plaintext payload of ``doc``, or None (logged; the replica catches up)."""
        if self.cipher is None:
            if "m" in doc:
                return doc
            self._unopened("sealed, and this replica has no at-rest key", payload)
            return None
        sealed = doc.get("s")
        if not isinstance(sealed, str):
            self._unopened("not sealed", payload)
            return None
        try:
            inner = json.loads(self.cipher.open(base64.b64decode(sealed, validate=True)))
        except (AtRestError, ValueError):
            self._unopened("does not open with this replica's at-rest key", payload)
            return None
        if not isinstance(inner, dict) or inner.get("r") != doc.get("r"):
            self._unopened("names another sender inside", payload)
            return None
        return inner

    def _unopened(self, why: str, payload: str) -> None:
        """A payload this replica cannot read: whatever it said may have been missed, so
        catch up from the rows (as after a gap; coalesced, :meth:`_catch_up_soon`)."""
        self.unopened += 1
        at, count = self._unopened_logged
        now = time.monotonic()
        if now - at >= UNOPENED_LOG_EVERY_S:
            log.warning("replica %s ignored %d notification(s) that it cannot read (the last: "
                        "%s; %.60r…); catching up from the rows. Replicas must share one "
                        "at-rest key (SPARECYCLES_AT_REST_KEY)", self.replica_id,
                        self.unopened - count, why, payload)
            self._unopened_logged = (now, self.unopened)
        self._catch_up_soon()

    # ---- sending -------------------------------------------------------------------
    def _send_loop(self) -> None:
        conn: psycopg.Connection | None = None
        failures = 0
        while True:
            with self._cond:
                while not self._out and not self._closed:
                    self._cond.wait()
                if self._closed and not self._out:
                    break
                batch = list(self._out)
                self._out.clear()
            payloads = self._pack(batch)
            for attempt in range(2):
                try:
                    if conn is None or conn.closed:
                        conn = psycopg.connect(self.conninfo, autocommit=True)
                    for payload in payloads:
                        conn.execute("SELECT pg_notify(%s, %s)", (self.channel, payload))
                        self.sent += 1
                    failures = 0
                    break
                except Exception as exc:  # noqa: BLE001 - reconnect once, then drop
                    try:
                        if conn is not None:
                            conn.close()
                    except Exception:  # noqa: BLE001
                        pass
                    conn = None
                    if attempt:
                        failures += 1
                        log.warning("replica %s could not notify the others (%s): %d "
                                    "wake-ups lost; they catch up from the rows",
                                    self.replica_id, exc, len(batch))
                        time.sleep(RETRY_S[min(failures, len(RETRY_S) - 1)])
        if conn is not None:
            conn.close()

    def _pack(self, batch: list[tuple[str, dict]]) -> list[str]:
        """The messages as few payloads as fit (each a JSON document of at most
        :attr:`budget` bytes, then sealed when the bus has a key). A message too large
        loses its ``c`` (a copy the receivers can read from the rows); one still too large
        is dropped (logged)."""
        head, budget = self._head, self.budget
        out, parts, size = [], [], len(head) + 2
        for kind, data in batch:
            part = json.dumps([kind, data], separators=(",", ":"))
            if len(part) + len(head) + 2 > budget and "c" in data:
                part = json.dumps([kind, {k: v for k, v in data.items() if k != "c"}],
                                  separators=(",", ":"))
            if len(part) + len(head) + 2 > budget:
                log.warning("dropped a %s wake-up of %d bytes (too large to notify)", kind,
                            len(part))
                continue
            if parts and size + len(part) + 1 > budget:
                out.append(head + ",".join(parts) + "]}")
                parts, size = [], len(head) + 2
            parts.append(part)
            size += len(part) + 1
        if parts:
            out.append(head + ",".join(parts) + "]}")
        return out if self.cipher is None else [self._seal(p) for p in out]

    def _seal(self, payload: str) -> str:
        sealed = base64.b64encode(self.cipher.seal(payload.encode())).decode("ascii")
        return json.dumps({"r": self.replica_id, "s": sealed}, separators=(",", ":"))


def bus_for(db_url: str, replica_id: str | None = None, cipher: AtRestCipher | None = None):
    """The bus a broker on ``db_url`` uses: LISTEN/NOTIFY on PostgreSQL, its payloads sealed
    with ``cipher`` (the at-rest key); on SQLite (one process, see broker.storage.lock) the
    in-process :class:`LocalBus`."""
    from broker.replicas.bus import LocalBus

    if make_url(db_url).drivername.startswith("postgresql"):
        return PgNotifyBus(db_url, replica_id=replica_id, cipher=cipher)
    return LocalBus(replica_id)
