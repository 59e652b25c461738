"""MarketService: the live order book. Keeps one standing ask per (provider, plugin) in the
auction's :class:`OrderBook`, completed with the broker's facts (measured θ, reliability,
free slots), and clears jobs against it.

Asks are sealed: only :meth:`asks` reads them back, and the API shows them to their owner
and to admins only. An agent that posts no ask for a plugin stands at the reserve (it takes
whatever the market pays, at most the reserve). Jobs do not pin weights yet, so every ask
of a plugin version shares one bucket (weights digest ``ANY_WEIGHTS``).
Thread-safe: one lock serialises posts, capacity changes and clearing.
"""
from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from broker.auction import (Ask, AuctionRules, CannotMeetTerms, ClearingResult, InvalidAsk,
                            JobSpec, NoEligibleProvider, OrderBook, Priority, clear)

from .errors import InvalidBenchmark, PluginNotServed
from .throughput import ThroughputTracker

ANY_WEIGHTS = "any"


@dataclass(frozen=True)
class MarketSettings:
    """``claimed_throughput_factor``: weight of an agent's unmeasured benchmark claim (0: a
    provider is eligible only once the broker measured it, DESIGN §4). ``canary_interval_s``:
    how often each (provider, plugin) gets a canary job once measured (0: only the first)."""

    claimed_throughput_factor: float = 0.0
    overclaim_factor: float = 2.0
    canary_interval_s: float = 600.0
    canary_timeout_s: float = 120.0


@dataclass
class ProviderState:
    provider_id: str
    operator_id: str
    plugins: dict[str, str]                      # plugin -> version
    vram_gb: float = 0.0
    free: int = 1
    asks: dict[str, int] = field(default_factory=dict)   # posted asks; absent: the reserve
    online: bool = True


@dataclass
class Canary:
    job_id: str
    provider_id: str
    plugin: str
    work_units: float
    sent_at: float


class MarketService:
    def __init__(self, reserve_of: Callable[[str], int], settings: MarketSettings | None = None,
                 *, rng: random.Random | None = None, clock=time.time):
        self.settings = settings or MarketSettings()
        self.rules = AuctionRules(claimed_throughput_factor=self.settings.claimed_throughput_factor)
        self.book = OrderBook(self.rules)
        self.tracker = ThroughputTracker(overclaim_factor=self.settings.overclaim_factor)
        self.reserve_of = reserve_of
        self.rng = rng or random.Random()
        self.clock = clock
        self._lock = threading.RLock()
        self._providers: dict[str, ProviderState] = {}
        self._canaries: dict[str, Canary] = {}
        self._last_canary: dict[tuple[str, str], float] = {}

    # ---- providers -----------------------------------------------------------------
    def connect(self, provider_id: str, operator_id: str, plugins: dict[str, str], *,
                vram_gb: float = 0.0, free: int = 1,
                benchmarks: dict[str, float] | None = None,
                asks: dict[str, int] | None = None) -> dict[str, Exception | None]:
        """A provider came online. Returns, per ask posted with the connection, None when
        accepted or the error that refused it (its previous valid ask then stands)."""
        with self._lock:
            old = self._providers.get(provider_id)
            state = ProviderState(provider_id, operator_id, dict(plugins), vram_gb, free,
                                  asks=dict(old.asks) if old else {})
            state.asks = {p: a for p, a in state.asks.items() if p in plugins}
            self._providers[provider_id] = state
            self.book.withdraw(provider_id)
            for plugin, units in (benchmarks or {}).items():
                self.report_benchmark(provider_id, plugin, units)
            self._repost(state)
            results: dict[str, Exception | None] = {}
            for plugin, price in (asks or {}).items():
                try:
                    self.post_ask(provider_id, plugin, price)
                    results[plugin] = None
                except (InvalidAsk, PluginNotServed) as exc:
                    results[plugin] = exc
            return results

    def disconnect(self, provider_id: str) -> None:
        with self._lock:
            state = self._providers.get(provider_id)
            if state is not None:
                state.online = False
                self.book.withdraw(provider_id)

    def mark_online(self, provider_id: str) -> None:
        """The provider's current session is registered: make sure it is in the book. (An
        agent that reconnects joins the market before its new session replaces the old
        one; the old stream closing in between marks the provider offline.)"""
        with self._lock:
            state = self._providers.get(provider_id)
            if state is None or state.online:
                return
            state.online = True
            self._repost(state)

    def set_free(self, provider_id: str, free: int) -> None:
        with self._lock:
            state = self._providers.get(provider_id)
            if state is None or state.free == max(0, free):
                return
            state.free = max(0, free)
            if state.online:
                self.book.update_provider(provider_id, slots_free=min(state.free,
                                                                      self.rules.max_slots))

    def post_ask(self, provider_id: str, plugin: str, price_micro_per_unit: int) -> int:
        """Post or replace a standing ask. Raises :class:`InvalidAsk` or
        :class:`PluginNotServed`; the previous valid ask then stands."""
        with self._lock:
            state = self._providers.get(provider_id)
            if state is None or plugin not in state.plugins:
                served = sorted(state.plugins) if state else []
                raise PluginNotServed(
                    f"ask for {plugin!r} refused: this agent serves {served}; post asks only "
                    "for plugins listed in its capabilities")
            self.book.post(self._ask(state, plugin, price_micro_per_unit))  # validates first
            state.asks[plugin] = price_micro_per_unit
            return price_micro_per_unit

    def report_benchmark(self, provider_id: str, plugin: str, units_per_s: float) -> None:
        """Record the agent's claim. Raises :class:`InvalidBenchmark` for impossible values."""
        limit = self.rules.max_throughput_units_per_s
        if (isinstance(units_per_s, bool) or not isinstance(units_per_s, (int, float))
                or not math.isfinite(units_per_s) or not 0 < units_per_s <= limit):
            raise InvalidBenchmark(
                f"benchmark for {plugin!r} refused: units_per_s must be a finite number above 0 "
                f"and at most {limit:g}; got {units_per_s!r}")
        with self._lock:
            state = self._providers.get(provider_id)
            if state is None or plugin not in state.plugins:
                raise PluginNotServed(f"benchmark for {plugin!r} refused: this agent does not "
                                      "serve it")
            self.tracker.claim(provider_id, plugin, float(units_per_s))
            self._repost(state)

    # ---- measurements ----------------------------------------------------------------
    def observe(self, provider_id: str, plugin: str, work_units: float, run_ms: float) -> None:
        """A timed run (a real job's receipt or a canary) on this provider."""
        with self._lock:
            if self.tracker.observe(provider_id, plugin, work_units, run_ms) is None:
                return
            state = self._providers.get(provider_id)
            if state is not None and state.online:
                self._repost(state)

    def failed(self, provider_id: str, plugin: str) -> None:
        with self._lock:
            self.tracker.failed(provider_id, plugin)
            state = self._providers.get(provider_id)
            if state is not None and state.online:
                self._repost(state)

    def theta(self, provider_id: str, plugin: str) -> tuple[float, bool]:
        with self._lock:
            return self.tracker.theta(provider_id, plugin)

    def measured_any(self, plugin: str) -> bool:
        """Has the broker measured any online provider of ``plugin``? Until it has (a cold
        market), the dispatcher hands jobs out by the spine's rule at the reserve, and those
        jobs' receipts are the first measurements."""
        with self._lock:
            return any(s.online and plugin in s.plugins
                       and self.tracker.theta(pid, plugin)[1]
                       for pid, s in self._providers.items())

    def flagged(self, provider_id: str, plugin: str) -> bool:
        with self._lock:
            return self.tracker.record_of(provider_id, plugin).flagged

    # ---- canaries --------------------------------------------------------------------
    def canaries_due(self, provider_id: str) -> list[str]:
        """Plugins of this provider that need a canary now: never measured, or the last
        canary is older than ``canary_interval_s``; none while one is out."""
        now = self.clock()
        with self._lock:
            state = self._providers.get(provider_id)
            if state is None or not state.online:
                return []
            out = {c.plugin for c in self._canaries.values() if c.provider_id == provider_id}
            due = []
            for plugin in state.plugins:
                if plugin in out:
                    continue
                last = self._last_canary.get((provider_id, plugin))
                theta, measured = self.tracker.theta(provider_id, plugin)
                if last is None and not measured and theta > 0:  # a claim to check
                    due.append(plugin)
                elif (last is not None and self.settings.canary_interval_s > 0
                      and now - last >= self.settings.canary_interval_s):
                    due.append(plugin)
            return due

    def canary_sent(self, canary: Canary) -> None:
        with self._lock:
            self._canaries[canary.job_id] = canary
            self._last_canary[(canary.provider_id, canary.plugin)] = canary.sent_at

    def canary(self, job_id: str) -> Canary | None:
        with self._lock:
            return self._canaries.get(job_id)

    def canary_done(self, job_id: str) -> Canary | None:
        with self._lock:
            return self._canaries.pop(job_id, None)

    def expired_canaries(self) -> list[Canary]:
        now = self.clock()
        with self._lock:
            gone = [c for c in self._canaries.values()
                    if now - c.sent_at > self.settings.canary_timeout_s]
            for c in gone:
                del self._canaries[c.job_id]
            return gone

    # ---- clearing --------------------------------------------------------------------
    def spec(self, *, plugin: str, version: str, work_units: float, client_id: str,
             priority: str = "standard", max_price_micro: int | None = None,
             deadline_s: float | None = None, n_slots: int = 1,
             excluded: frozenset[str] = frozenset(), job_id: str | None = None) -> JobSpec:
        return JobSpec(plugin=plugin, plugin_version=version, weights_digest=ANY_WEIGHTS,
                       work_units=float(work_units), client_id=client_id,
                       reserve_micro_per_unit=self.reserve_of(plugin),
                       priority=Priority(priority), max_price_micro=max_price_micro,
                       deadline_s=deadline_s, n_slots=n_slots, excluded_provider_ids=excluded,
                       job_id=job_id)

    def clear(self, spec: JobSpec) -> ClearingResult:
        """Clear without taking slots (the dispatcher marks them busy when it assigns).
        Raises :class:`NoEligibleProvider` / :class:`CannotMeetTerms`."""
        with self._lock:
            return clear(spec, self.book, self.rng, self.clock())

    def check_terms(self, spec: JobSpec) -> None:
        """Admission: raise :class:`CannotMeetTerms` when eligible providers exist but none
        meets the client's max price or deadline. A market with no free eligible provider
        passes: the job may queue until capacity appears."""
        try:
            self.clear(spec)
        except NoEligibleProvider:
            return
        except CannotMeetTerms:
            raise

    # ---- reads (owner and admins only) -------------------------------------------------
    def asks(self, provider_ids: set[str] | None = None) -> list[dict]:
        with self._lock:
            rows = []
            for pid, state in self._providers.items():
                if provider_ids is not None and pid not in provider_ids:
                    continue
                for plugin, version in sorted(state.plugins.items()):
                    rec = self.tracker.record_of(pid, plugin)
                    posted = state.asks.get(plugin)
                    rows.append({
                        "provider_id": pid, "plugin": plugin, "version": version,
                        "price_micro_per_unit": posted if posted is not None
                        else self.reserve_of(plugin),
                        "at_reserve": posted is None, "online": state.online,
                        "claimed_units_per_s": rec.claimed_units_per_s,
                        "measured_units_per_s": rec.measured_units_per_s,
                        "samples": rec.samples, "overclaim_flagged": rec.flagged,
                        "reliability": round(rec.reliability, 4)})
            return rows

    # ---- internals -------------------------------------------------------------------
    def _ask(self, state: ProviderState, plugin: str, price: int) -> Ask:
        theta, measured = self.tracker.theta(state.provider_id, plugin)
        theta = min(theta, self.rules.max_throughput_units_per_s)
        rec = self.tracker.record_of(state.provider_id, plugin)
        return Ask(provider_id=state.provider_id, operator_id=state.operator_id, plugin=plugin,
                   plugin_version=state.plugins[plugin], weights_digest=ANY_WEIGHTS,
                   price_micro_per_unit=price, throughput_units_per_s=theta,
                   throughput_measured=measured, reliability=rec.reliability,
                   slots_free=min(state.free, self.rules.max_slots),
                   vram_gb=min(state.vram_gb, self.rules.max_vram_gb), online=state.online)

    def _repost(self, state: ProviderState) -> None:
        for plugin in state.plugins:
            price = state.asks.get(plugin)
            if price is None:
                price = min(self.reserve_of(plugin), self.rules.max_ask_micro_per_unit)
            self.book.post(self._ask(state, plugin, price))
