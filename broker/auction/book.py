"""The order book: every standing ask, indexed for fast clearing.

Asks are bucketed by plugin build ``(plugin, version, weights digest)``, so a job only
ever looks at asks that can run it. Inside a bucket, the asks that could take a job now
(online, a free slot, a usable throughput) are kept in *views*, one per ``(λ, F)`` pair in
use (in practice one per priority): two lists sorted by the two parts of the score,
``u = ask + λ/θ`` and ``v = λ·(queue + cold start) + (1 − reliability)·F``. Since
``score = W·u + v`` with ``W, λ, F ≥ 0``, clearing runs Fagin's threshold algorithm over the
two lists: it reads both in order, scores what it meets, and stops as soon as
``W·u_next + v_next`` (a lower bound on every unread ask) exceeds the best losing score. A
job thus touches tens to a few hundred asks instead of all of them, and nothing is sorted
per job. Adding, changing or withdrawing an ask costs a bisection and a list insert per
view, and only in the lists whose part of the score it moved (taking or freeing a slot of
an ask that stays active moves neither). Views are built on first use and the least
recently used beyond ``rules.max_cached_views`` are dropped.

Not thread-safe: the broker owns one book per process and serialises writes and clearing
(one lock, or one task), which is what clearing against standing asks needs anyway.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import replace

from .errors import UnknownAsk
from .model import Ask, AuctionRules
from .scoring import effective_throughput, is_active, score_parts
from .validation import same_checks, validate_ask, validate_fields

BuildKey = tuple[str, str, str]


class _View:
    """Active asks of one bucket sorted by u and by v for one (λ, F)."""

    __slots__ = ("lam", "penalty", "by_u", "by_v", "parts")

    def __init__(self, lam: float, penalty: float):
        self.lam = lam
        self.penalty = penalty
        self.by_u: list[tuple[float, str]] = []
        self.by_v: list[tuple[float, str]] = []
        self.parts: dict[str, tuple[float, float, float]] = {}  # pid -> (u, v, λ/θ)

    def put(self, ask: Ask, theta: float) -> None:
        """Index ``ask`` (new, or replacing the provider's entry). A list is only touched
        when the ask's key in it moved: most changes move one part of the score (a queue
        moves v, a new θ mostly u) or neither (a slot taken or freed)."""
        u, v = score_parts(ask, self.lam, self.penalty, theta)
        pid = ask.provider_id
        old = self.parts.get(pid)
        self.parts[pid] = (u, v, self.lam / theta)
        if old is None:
            bisect.insort(self.by_u, (u, pid))
            bisect.insort(self.by_v, (v, pid))
            return
        if old[0] != u:
            _move(self.by_u, (old[0], pid), (u, pid))
        if old[1] != v:
            _move(self.by_v, (old[1], pid), (v, pid))

    def discard(self, pid: str) -> None:
        parts = self.parts.pop(pid, None)
        if parts is None:
            return
        for lst, key in ((self.by_u, (parts[0], pid)), (self.by_v, (parts[1], pid))):
            del lst[bisect.bisect_left(lst, key)]


def _move(lst: list[tuple[float, str]], old: tuple[float, str], new: tuple[float, str]) -> None:
    """Replace ``old`` by ``new`` in the sorted ``lst``."""
    del lst[bisect.bisect_left(lst, old)]
    bisect.insort(lst, new)


class Bucket:
    """All asks for one plugin build. Read-only to callers outside the book."""

    __slots__ = ("key", "asks", "_views", "_rules")

    def __init__(self, key: BuildKey, rules: AuctionRules):
        self.key = key
        self.asks: dict[str, Ask] = {}
        self._views: OrderedDict[tuple[float, float], _View] = OrderedDict()
        self._rules = rules

    def _put(self, ask: Ask) -> None:
        """Add or replace the provider's ask. A replaced ask goes last in ``asks`` as a new
        one does (refusals count reasons in book order)."""
        pid = ask.provider_id
        self.asks.pop(pid, None)
        self.asks[pid] = ask
        if is_active(ask, self._rules):
            theta = effective_throughput(ask, self._rules)
            for view in self._views.values():
                view.put(ask, theta)
        else:
            for view in self._views.values():
                view.discard(pid)

    def _remove(self, pid: str) -> Ask | None:
        old = self.asks.pop(pid, None)
        if old is not None:
            for view in self._views.values():
                view.discard(pid)
        return old

    def view(self, lam: float, penalty: float) -> _View:
        """The (λ, F) index, built on first use."""
        key = (float(lam), float(penalty))
        view = self._views.get(key)
        if view is not None:
            self._views.move_to_end(key)
            return view
        view = _View(*key)
        rules = self._rules
        rows_u, rows_v = [], []
        for pid, ask in self.asks.items():
            if is_active(ask, rules):
                theta = effective_throughput(ask, rules)
                u, v = score_parts(ask, view.lam, view.penalty, theta)
                view.parts[pid] = (u, v, view.lam / theta)
                rows_u.append((u, pid))
                rows_v.append((v, pid))
        rows_u.sort()
        rows_v.sort()
        view.by_u, view.by_v = rows_u, rows_v
        self._views[key] = view
        while len(self._views) > rules.max_cached_views:
            self._views.popitem(last=False)
        return view

    def __len__(self) -> int:
        return len(self.asks)


class OrderBook:
    """In-memory standing asks of every provider, validated on entry. Usage::

        book = OrderBook(rules)
        book.post(ask)                    # add or replace; InvalidAsk leaves the old one
        book.update_provider("p1", queue_s=12.0, online=False)
        book.occupy("p1")                 # the broker assigned it a job: one slot fewer
        book.release("p1")                # the job ended
        book.withdraw("p1", plugin="sd15")
    """

    def __init__(self, rules: AuctionRules | None = None):
        self.rules = rules or AuctionRules()
        self._buckets: dict[BuildKey, Bucket] = {}
        self._by_provider: dict[str, set[BuildKey]] = {}
        # Whether every standing ask passed validation under the current rules (see
        # update_provider); rules with other bounds leave asks posted before them unchecked.
        self._valid = True

    # -- writes ---------------------------------------------------------------------------
    def set_rules(self, rules: AuctionRules) -> None:
        """Change the market's rules (an admin moved the reputation floor, say). Standing
        asks stay; the sorted views are rebuilt on their next use, since the rules decide
        which asks are active and how a claimed throughput counts."""
        self._valid = self._valid and same_checks(self.rules, rules)
        self.rules = rules
        for bucket in self._buckets.values():
            bucket._rules = rules
            bucket._views.clear()

    def post(self, ask: Ask) -> None:
        """Add ``ask`` or replace the provider's ask for the same plugin build. Raises
        :class:`InvalidAsk` before touching anything, so the previous valid ask stands."""
        validate_ask(ask, self.rules)
        bucket = self._buckets.get(ask.build_key)
        if bucket is None:
            bucket = self._buckets[ask.build_key] = Bucket(ask.build_key, self.rules)
        bucket._put(ask)
        self._by_provider.setdefault(ask.provider_id, set()).add(ask.build_key)

    def post_many(self, asks: Iterable[Ask]) -> None:
        for ask in asks:
            self.post(ask)

    def update_provider(self, provider_id: str, **changes) -> int:
        """Apply capacity changes (``online``, ``slots_free``, ``queue_s``, ``reliability``,
        ...) to every ask of a provider; all are validated first, so either every ask
        changes or none does. Returns how many asks changed."""
        keys = self._by_provider.get(provider_id, ())
        new = [replace(self._buckets[k].asks[provider_id], **changes) for k in keys]
        if new and self._valid:
            # The asks are valid and get the same new values: checking the changed fields
            # of one of them is the full check of all of them.
            validate_fields(new[0], changes, self.rules)
        else:
            for ask in new:
                validate_ask(ask, self.rules)
        for ask in new:
            self._buckets[ask.build_key]._put(ask)
        return len(new)

    def repost(self, provider_id: str, asks: list[Ask]) -> None:
        """Replace all the provider's asks with ``asks``: ``withdraw(provider_id)`` then
        ``post_many(asks)``, all validated first (on :class:`InvalidAsk` nothing changes),
        leaving the book in the same order, but keeping the sorted views of the buckets
        the provider stays in rather than dropping and rebuilding them."""
        for ask in asks:
            validate_ask(ask, self.rules)
        old = self._by_provider.pop(provider_id, set())
        new = {ask.build_key for ask in asks}
        for k in old - new:
            self._drop(k, provider_id)
        # Where the provider was alone, withdraw would have deleted the bucket and the post
        # created it again, last in the book: move it there, with its views.
        alone = {k for k in old & new if len(self._buckets[k].asks) == 1}
        for ask in asks:
            k = ask.build_key
            if k in alone:
                alone.discard(k)
                self._buckets[k] = self._buckets.pop(k)
            bucket = self._buckets.get(k)
            if bucket is None:
                bucket = self._buckets[k] = Bucket(k, self.rules)
            bucket._put(ask)
        if new:
            self._by_provider[provider_id] = new

    def occupy(self, provider_id: str, n: int = 1) -> None:
        """Take ``n`` of the provider's free slots (slots are per machine, shared by all its
        asks). Call it for each award the broker assigns; never below zero."""
        for k in self._by_provider.get(provider_id, ()):
            ask = self._buckets[k].asks[provider_id]
            self._buckets[k]._put(replace(ask, slots_free=max(0, ask.slots_free - n)))

    def release(self, provider_id: str, n: int = 1) -> None:
        """Give ``n`` slots back when a job ends (capped by ``rules.max_slots``)."""
        for k in self._by_provider.get(provider_id, ()):
            ask = self._buckets[k].asks[provider_id]
            self._buckets[k]._put(replace(
                ask, slots_free=min(self.rules.max_slots, ask.slots_free + n)))

    def withdraw(self, provider_id: str, plugin: str | None = None,
                 plugin_version: str | None = None, weights_digest: str | None = None) -> int:
        """Remove the provider's asks (all, or those matching the given build fields).
        Returns how many were removed."""
        keys = self._by_provider.get(provider_id)
        if not keys:
            return 0
        gone = [k for k in keys if (plugin is None or k[0] == plugin)
                and (plugin_version is None or k[1] == plugin_version)
                and (weights_digest is None or k[2] == weights_digest)]
        for k in gone:
            self._drop(k, provider_id)
            keys.discard(k)
        if not keys:
            del self._by_provider[provider_id]
        return len(gone)

    def _drop(self, key: BuildKey, provider_id: str) -> None:
        """Remove the provider's ask from a bucket, and the bucket once it is empty."""
        bucket = self._buckets[key]
        bucket._remove(provider_id)
        if not bucket.asks:
            del self._buckets[key]

    # -- reads ----------------------------------------------------------------------------
    def get(self, provider_id: str, build_key: BuildKey) -> Ask:
        """The provider's standing ask for a plugin build (only the provider itself and
        the broker's internals may see it)."""
        bucket = self._buckets.get(tuple(build_key))
        ask = bucket.asks.get(provider_id) if bucket else None
        if ask is None:
            raise UnknownAsk(f"provider {provider_id!r} has no standing ask for {build_key!r}")
        return ask

    def bucket(self, build_key: BuildKey) -> Bucket | None:
        return self._buckets.get(tuple(build_key))

    def asks_for_plugin(self, plugin: str) -> Iterator[Ask]:
        """Every ask for any build of ``plugin`` (for diagnostics; a full scan)."""
        for key, bucket in self._buckets.items():
            if key[0] == plugin:
                yield from bucket.asks.values()

    def __iter__(self) -> Iterator[Ask]:
        for bucket in self._buckets.values():
            yield from bucket.asks.values()

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())
