"""ReplicaRegistry: the broker processes serving on one database, and which of them holds
each agent's stream (issue #21).

Each replica writes a row at start (its id, its signing key's public half, its addresses)
and refreshes it every ``beat_s``; a row older than ``stale_after_s`` is a dead replica
(SIGKILLed, its machine gone): the first live replica to notice deletes it and clears the
streams it held, so presence never counts an agent behind a dead replica. An agent's
stream is recorded as held by the replica it connected to (``providers.replica_id``) and
cleared when it leaves; a reader believes it only while the holder's row is fresh.

The signing key is checked at start: an agent verifies every envelope against the key the
broker proved in its challenge, so replicas must sign with one key. A replica whose key
differs from a live replica's refuses to start, saying how to share it.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

log = logging.getLogger(__name__)


class ReplicaMismatch(RuntimeError):
    """This replica cannot serve beside the live ones (another signing key)."""


class ReplicaStore(Protocol):
    def join(self, replica_id: str, public_key: str, http: str, grpc: str, now: float) -> None: ...
    def beat(self, replica_id: str, now: float) -> None: ...
    def leave(self, replica_id: str) -> None: ...
    def live(self, since: float) -> list[tuple[str, str, float]]:
        """(replica id, public key, seen at) of the replicas seen at ``since`` or later."""
        ...
    def bury(self, since: float) -> list[str]:
        """Delete the replicas not seen since ``since`` and clear the streams they held;
        returns their ids."""
        ...
    def hold(self, provider_id: str, replica_id: str) -> None: ...
    def release(self, provider_id: str, replica_id: str) -> None: ...
    def holders(self, since: float) -> dict[str, str]:
        """provider id -> replica id, for streams held by replicas seen since ``since``."""
        ...


class ReplicaRegistry:
    def __init__(self, store: ReplicaStore, replica_id: str, public_key: str, *,
                 beat_s: float = 2.0, stale_after_s: float = 15.0, clock=time.time):
        self.store = store
        self.replica_id = replica_id
        self.public_key = public_key
        self.beat_s = beat_s
        self.stale_after_s = stale_after_s
        self.clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def join(self, http: str = "", grpc: str = "") -> None:
        """Check the signing key against the live replicas' and write this one's row."""
        now = self.clock()
        self.store.bury(now - self.stale_after_s)
        others = [r for r in self.store.live(now - self.stale_after_s) if r[0] != self.replica_id]
        odd = [r for r in others if r[1] != self.public_key]
        if odd:
            raise ReplicaMismatch(
                f"this broker signs with key {self.public_key[:16]}…, but the replica "
                f"{odd[0][0]} serving on the same database signs with {odd[0][1][:16]}…; "
                "agents check every envelope against one broker key, so replicas must share "
                "it: give every replica the same SPARECYCLES_BROKER_SIGNING_KEY (the 64 hex "
                "digits of the seed) or the same key file (SPARECYCLES_BROKER_KEY)")
        self.store.join(self.replica_id, self.public_key, http, grpc, now)
        if others:
            log.info("replica %s joins %d live replica(s): %s", self.replica_id, len(others),
                     ", ".join(r[0] for r in others))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="replica-beat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        try:
            self.store.leave(self.replica_id)
        except Exception:  # noqa: BLE001 - its row goes stale and is buried by the others
            log.exception("could not remove replica %s's row", self.replica_id)

    def _run(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                now = self.clock()
                self.store.beat(self.replica_id, now)
                for dead in self.store.bury(now - self.stale_after_s):
                    log.warning("replica %s stopped beating for %gs: counted as dead; the "
                                "agent streams it held are gone (their leases run out and "
                                "their jobs are requeued)", dead, self.stale_after_s)
            except Exception:  # noqa: BLE001 - a database blip: beat again next time
                log.exception("replica %s could not refresh its row", self.replica_id)

    # ---- agent streams ---------------------------------------------------------------
    def hold(self, provider_id: str) -> None:
        self.store.hold(provider_id, self.replica_id)

    def release(self, provider_id: str) -> None:
        try:
            self.store.release(provider_id, self.replica_id)
        except Exception:  # noqa: BLE001 - the row is believed only while we beat
            log.exception("could not clear the stream of %s", provider_id)

    def held_elsewhere(self) -> dict[str, str]:
        """provider id -> replica id of the streams live other replicas hold now."""
        since = self.clock() - self.stale_after_s
        return {p: r for p, r in self.store.holders(since).items() if r != self.replica_id}
