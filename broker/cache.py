"""TtlCache: values loaded by key and kept a few seconds.

For facts read often and changed rarely (a plugin's price and policy, a provider's owner):
a change made through this broker invalidates its key, so it applies at once here; one made
on another replica shows within ``ttl_s``.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TtlCache(Generic[K, V]):
    """``get(key, load)`` returns the cached value while it is younger than ``ttl_s``
    (monotonic clock), else ``load(key)``, which is kept; ``fresh=True`` always loads
    (read-modify-write must start from the stored value, never a cached one). ``cache_none=False``: a None
    from ``load`` is returned but not kept (the next get asks again). Thread-safe; a load
    that was under way when :meth:`invalidate` ran is returned to its caller but not kept,
    so an invalidation is never undone by an older read."""

    def __init__(self, ttl_s: float, *, cache_none: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_s = float(ttl_s)
        self.cache_none = cache_none
        self.clock = clock
        self._entries: dict[K, tuple[float, V]] = {}
        self._generation = 0
        self._lock = threading.Lock()

    def get(self, key: K, load: Callable[[K], V], *, fresh: bool = False) -> V:
        now = self.clock()
        with self._lock:
            hit = None if fresh else self._entries.get(key)
            generation = self._generation
        if hit is not None and hit[0] > now:
            return hit[1]
        value = load(key)
        if value is not None or self.cache_none:
            with self._lock:
                if generation == self._generation:
                    self._entries[key] = (now + self.ttl_s, value)
        return value

    def invalidate(self, key: K | None = None) -> None:
        """Drop ``key`` (None: every key); loads under way are not kept."""
        with self._lock:
            self._generation += 1
            if key is None:
                self._entries.clear()
            else:
                self._entries.pop(key, None)
