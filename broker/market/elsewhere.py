"""The providers other broker replicas hold, as a market admission can clear against
(issue #21).

A replica's order book holds the agents connected to it: that is what it places jobs on.
Admission must answer alike on every replica, so :meth:`MarketService.check_terms` also
asks this view: a market rebuilt from the database (the streams live replicas hold, each
provider's advertised builds and memory, its stored asks, the figures θ and reliability)
at most every ``ttl_s``. Each such provider counts as one free slot, warm, with an empty
queue: admission asks whether the terms could be met, not when. They enter that market as
any provider enters this replica's: as a session held by the market's own
:class:`~broker.jobs.presence.ProviderPresence` (one that records no stream).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from broker.auction import ClearingResult, JobSpec
from broker.jobs.presence import AgentSession

from .figures import FigureStore


class MarketElsewhere:
    """``new_market()`` builds an empty :class:`MarketService` on a presence of its own
    (the asks store and rules loaded, no bus, no figures of its own); ``held()`` gives
    provider id -> replica id of the streams other live replicas hold; ``providers(ids)``
    their stored records."""

    def __init__(self, new_market: Callable[[], object], held: Callable[[], dict[str, str]],
                 providers: Callable[[list[str]], list], figures: FigureStore, *,
                 ttl_s: float = 2.0, clock=time.monotonic):
        self.new_market = new_market
        self.held = held
        self.providers = providers
        self.figures = figures
        self.ttl_s = ttl_s
        self.clock = clock
        self._market = None
        self._built_at = float("-inf")
        self._lock = threading.Lock()

    def clear(self, spec: JobSpec) -> ClearingResult:
        return self.market().clear(spec)

    def market(self):
        with self._lock:
            if self._market is None or self.clock() - self._built_at >= self.ttl_s:
                self._market = self._build()
                self._built_at = self.clock()
            return self._market

    def _build(self):
        market = self.new_market()
        ids = sorted(self.held())
        if not ids:
            return market
        for p in self.providers(ids):
            if p.status != "active":
                continue  # paused or banned: takes no job, so meets no terms
            builds: dict[str, tuple[str, str]] = {}  # name -> (version, digest): one each
            for entry in p.plugins or []:
                if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                    builds[entry["name"]] = (str(entry.get("version", "")),
                                             str(entry.get("weights_digest") or ""))
            hw = p.hardware or {}
            memory = (hw.get("vram_gb") if hw.get("device") == "cuda"
                      else hw.get("memory_gb") or hw.get("vram_gb")) or 0.0
            market.presence.add(AgentSession(
                provider_id=p.id, public_key="", account_id=p.account_id,
                plugins={f"{name}@{version}": digest
                         for name, (version, digest) in builds.items()},
                slots=1, vram_gb=float(memory)))
        market.load_figures(self.figures.load_figures(ids))
        for pid in ids:
            market.refresh(pid)  # re-post with the loaded figures
        return market
