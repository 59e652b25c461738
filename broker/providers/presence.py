"""BuildsServed: whether some provider known to the broker serves a plugin build.

"Known" is: connected to this broker process now, or seen by any replica within
``window_s`` (the providers table's ``last_seen_at``: written when an agent connects,
refreshed by :meth:`BuildsServed.refresh` while it stays connected, and when it disconnects).
The window is what lets an agent that is a moment away count: a replica restarting, an
agent reconnecting after a network blip, or one connected to another replica. A job for a
build nobody is known to serve is refused at submit (nothing could run it, and its hold
would wait for nothing); a queued job whose build has had no provider for the whole window
is given up (``JobService.expire_unserved``), its hold voided.

Answers that need the database are kept for ``CACHE_S`` when they are yes: the hot path
(jobs for builds that agents on this replica serve) reads nothing, and a refusal always
asks the database afresh, so an agent that just connected to another replica is seen.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from .model import Provider

log = logging.getLogger(__name__)

#: How long a "yes, a provider seen lately serves it" read from the database is believed
#: (at most a tenth of the window).
CACHE_S = 2.0


def served_builds(provider: Provider) -> set[tuple[str, str]]:
    """The (plugin, version) pairs a provider advertised when it last connected."""
    out = set()
    for p in provider.plugins or []:
        if isinstance(p, dict) and isinstance(p.get("name"), str):
            out.add((p["name"], str(p.get("version", ""))))
    return out


class BuildsServed:
    """``repo``: the providers' storage (``seen_since(t) -> [Provider]``, ``touch(ids, t)``).
    ``serving(plugin, version)``: whether an agent connected to this process serves the
    build now; ``connected()``: their provider ids (both read the replica's
    :class:`broker.jobs.presence.ProviderPresence`)."""

    def __init__(self, repo, serving: Callable[[str, str], bool],
                 connected: Callable[[], Iterable[str]], *, window_s: float,
                 clock: Callable[[], float] = time.time):
        self.repo = repo
        self.serving = serving
        self.connected = connected
        self.window_s = float(window_s)
        self.cache_s = min(CACHE_S, self.window_s / 10)
        self.clock = clock
        self._yes: dict[tuple[str, str], float] = {}  # build -> until when a yes holds
        self._touched: dict[str, float] = {}          # provider -> last_seen_at we wrote
        self._lock = threading.Lock()

    def serves(self, plugin: str, version: str) -> bool:
        """Whether a provider connected here serves ``plugin@version``, or one that any
        replica saw within the window did."""
        if self.serving(plugin, version):
            return True
        build = (plugin, version)
        now = self.clock()
        with self._lock:
            if self._yes.get(build, 0.0) > now:
                return True
        seen = self.repo.seen_since(now - self.window_s)
        served = set()
        for p in seen:
            if p.status != "banned":
                served |= served_builds(p)
        with self._lock:
            for b in served:
                self._yes[b] = now + self.cache_s
        return build in served

    def refresh(self) -> int:
        """Write ``last_seen_at`` of the providers connected here whose stored one is older
        than a quarter of the window (the maintenance thread calls it each pass), so other
        replicas count them as present; returns how many were written."""
        now = self.clock()
        due = [pid for pid in set(self.connected())
               if now - self._touched.get(pid, float("-inf")) >= self.window_s / 4]
        if due:
            self.repo.touch(due, now)
            with self._lock:
                for pid in due:
                    self._touched[pid] = now
                for pid in [p for p in self._touched if p not in due
                            and now - self._touched[p] > self.window_s]:
                    del self._touched[pid]
        return len(due)

    def left(self, provider_id: str) -> None:
        """An agent's stream ended: it was seen until now (the window counts from here)."""
        now = self.clock()
        try:
            self.repo.touch([provider_id], now)
        except Exception:  # noqa: BLE001 - the connect time (or last refresh) stands
            log.exception("could not record when provider %s was last seen", provider_id)
        with self._lock:
            self._touched.pop(provider_id, None)
