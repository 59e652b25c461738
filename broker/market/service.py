"""MarketService: the live order book. Keeps one standing ask per (provider, plugin) in the
auction's :class:`OrderBook`, completed with the broker's facts (measured θ, reliability,
free slots, queue, cold start), and clears jobs against it.

Asks are sealed: only :meth:`asks` reads them back, and the API shows them to their owner
and to admins only. An agent that posts no ask for a plugin stands at the reserve (it takes
whatever the market pays, at most the reserve). Accepted asks are written through to an
:class:`~broker.market.store.AskStore`, so they survive a broker restart and an agent that
reconnects without re-posting keeps them.

Weights (see :mod:`.builds`): each ask is filed under the provider's advertised weights
digest, and also under ``ANY_WEIGHTS`` when the build's manifest pins none; a job clears in
the bucket of the digest pinned for it, so a provider with other weights is never even
looked at.

Expected completion = queue + cold start + W/θ. The queue is the provider's backlog: the
expected remaining seconds of the jobs and canaries it holds, over its slots. The cold
start is 0 when ``warm(provider_id, plugin)`` says the model is loaded (the default hook
says yes for every plugin served), else the agent's reported load time, else an estimate
from the manifest's weight sizes, else ``default_cold_start_s``.

Presence: the market keeps no record of who is connected, of free slots or of the jobs a
provider holds. It is built on the replica's :class:`~broker.jobs.presence.ProviderPresence`,
listens to it (a session joining enters the provider with the :class:`Offer` it carries;
one leaving withdraws it) and reads online, slots, free slots and leases from it. What it
keeps per provider is its own: the builds and weights it prices, memory, asks, cold starts,
and the queue and free slots as last posted to the book. Lock order: the presence's lock,
then the market's (``_locks``); the market never takes the presence's lock while holding its
own.

Reputation floor: each ask's reputation is the provider's reliability for the plugin
(successes over attempts, with one success of prior). Under ``reputation_floor`` it is not
eligible while any provider at or above the floor could take the job, free or busy: the
job waits for that one. When nobody at or above the floor could take it, the floor gives
way (see :func:`broker.auction.clearing.floor_gives_way`). Canary jobs keep measuring
providers under the floor, and their successes lift them back.
Thread-safe: one lock serialises posts, capacity changes and clearing; what reads the
presence takes its lock first (``_locks``).
"""
from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from sdk.protocol.canonical import is_sha256_hex

from broker.auction import (Ask, AuctionRules, CannotMeetTerms, ClearingResult, InvalidAsk,
                            InvalidJob, JobSpec, NoEligibleProvider, OrderBook, Priority, clear,
                            validate_ask)
from broker.jobs.presence import AgentSession, Lease, OfferReply, ProviderPresence
from sdk.protocol.manifest import Manifest

from . import builds
from .builds import ANY_WEIGHTS, NO_WEIGHTS
from .errors import InvalidBenchmark, PluginNotServed
from .figures import FigureStore
from .store import AskStore
from .throughput import ThroughputTracker
from .rules import MarketRules, _floor
from .standing import MarketStanding

log = logging.getLogger(__name__)

class Elsewhere(Protocol):
    """The providers other broker replicas hold, as a market that clears (admission only:
    jobs are placed by the replica holding the winner's stream)."""

    def clear(self, spec: JobSpec) -> ClearingResult: ...


#: A provider's queue is re-posted when it drifts by this much (seconds): time passing
#: shortens the backlog, and re-indexing on every tick would cost more than it tells.
QUEUE_RESOLUTION_S = 1.0


@dataclass(frozen=True)
class MarketSettings:
    """``claimed_throughput_factor``: weight of an agent's unmeasured benchmark claim (0: a
    provider is eligible only once the broker measured it, DESIGN §4). ``canary_interval_s``:
    how often each (provider, plugin) gets a canary job once measured (0: only the first).
    ``reputation_floor``: the reliability under which a provider is not eligible (an admin
    may change it at run time; the stored value then wins). ``default_cold_start_s``: the
    cold start of a model nobody measured and whose manifest lists no weight sizes."""

    claimed_throughput_factor: float = 0.0
    overclaim_factor: float = 2.0
    canary_interval_s: float = 600.0
    canary_timeout_s: float = 120.0
    reputation_floor: float = 0.5
    default_cold_start_s: float = 10.0


@dataclass
class ProviderState:
    """What the market itself keeps of a provider it priced: its builds, weights, memory,
    asks and cold starts. Whether it is online, its slots and its leases are the presence's
    (:class:`~broker.jobs.presence.ProviderPresence`); ``posted_free`` and ``queue_s`` are
    what the book was last given (the book is re-posted when they change)."""
    provider_id: str
    operator_id: str
    plugins: dict[str, str]                      # plugin -> version
    vram_gb: float = 0.0
    asks: dict[str, int] = field(default_factory=dict)   # posted asks; absent: the reserve
    digests: dict[str, str] = field(default_factory=dict)     # plugin -> advertised weights
    cold_start_s: dict[str, float] = field(default_factory=dict)  # plugin -> reported load s
    queue_s: float = 0.0                                          # as last posted
    posted_free: int = 0                                          # as last posted


@dataclass
class Canary:
    """A canary out on a provider; ``version`` and ``inputs`` are what it was sent with
    (verification compares the outputs with the answer known for them)."""
    job_id: str
    provider_id: str
    plugin: str
    work_units: float
    sent_at: float
    version: str = ""
    inputs: dict = field(default_factory=dict)
    source: str = ""  # the client job whose inputs it reused ("": the benchmark payload)
    # the class its envelope recorded and its weights (broker.jobs.repro): what it is judged in
    repro: dict = field(default_factory=dict)
    unavailable_reports: int = 0  # its session's count when it went out (canary.withdrawn)

    @property
    def since(self) -> float:
        """When it started, as for a :class:`Lease` (the queue counts both alike)."""
        return self.sent_at


class MarketService(MarketStanding, MarketRules):
    """``presence``: the agents this replica holds, the one record of who is online, its
    slots and leases (None: a fresh one of the market's own, as in a test or the market of
    the other replicas' providers, :mod:`.elsewhere`). ``manifest_of(plugin, version)``
    gives the catalog's manifest of a build (None when unknown): the source of weight pins
    and cold-start estimates. ``store`` keeps asks and admin-set rules across restarts
    (None: memory only). ``warm`` is a hook, ``warm(provider_id, plugin) -> bool``; call
    :meth:`refresh` when its answer changes.
    ``on_rule_changed(rule, before, after, by)`` is called after an admin changed a rule
    (the audit log hooks in here)."""

    def __init__(self, reserve_of: Callable[[str], int], settings: MarketSettings | None = None,
                 *, presence: ProviderPresence | None = None,
                 rng: random.Random | None = None, clock=time.time,
                 store: AskStore | None = None,
                 manifest_of: Callable[[str, str], Manifest | None] | None = None,
                 linked_to: Callable[[str], frozenset[str]] | None = None,
                 bus=None, figures: FigureStore | None = None,
                 elsewhere: "Elsewhere | None" = None,
                 warm: Callable[[str, str], bool] | None = None,
                 on_rule_changed: Callable[[str, float, float, str], None] | None = None):
        """``bus`` (broker.replicas.ReplicaBus): a rule an admin changes on another broker
        replica is read back from the store here at once. ``figures``: where θ,
        reliability and canary times outlive the process (:mod:`.figures`; None: memory
        only). ``elsewhere``: the providers other replicas hold, for admission
        (:meth:`check_terms`; None: this process is the whole broker)."""
        self.settings = settings or MarketSettings()
        # The accounts tied to an operator (broker.links): a provider never wins the job of
        # a client linked to its operator (DESIGN §4).
        self.linked_to = linked_to or (lambda operator: frozenset())
        self.bus = bus
        self.figures = figures
        self.elsewhere = elsewhere
        self._dirty: set[tuple[str, str]] = set()  # figures changed since the last flush
        self.store = store
        self.manifest_of = manifest_of or (lambda plugin, version: None)
        self.warm: Callable[[str, str], bool] = warm or (lambda provider_id, plugin: True)
        self.on_rule_changed: Callable[[str, float, float, str], None] = (
            on_rule_changed or (lambda rule, before, after, by: None))
        floor = self.settings.reputation_floor
        self._stored_asks: dict[str, dict[str, int]] = {}
        if store is not None:
            floor = store.load_rules().get("reputation_floor", floor)
            self._stored_asks = store.load_asks()
        self.rules = AuctionRules(claimed_throughput_factor=self.settings.claimed_throughput_factor,
                                  reputation_floor=_floor(floor))
        self.book = OrderBook(self.rules)
        self.tracker = ThroughputTracker(overclaim_factor=self.settings.overclaim_factor)
        self.reserve_of = reserve_of
        self.rng = rng or random.Random()
        self.clock = clock
        self._lock = threading.RLock()
        self._save_lock = threading.Lock()  # orders ask writes to the store (see _save_ask)
        self._providers: dict[str, ProviderState] = {}
        self._canaries: dict[str, Canary] = {}
        self._last_canary: dict[tuple[str, str], float] = {}
        self._pins: dict[tuple[str, str], str] = {}
        self.presence = presence if presence is not None else ProviderPresence()
        self.presence.listen(self)
        if bus is not None and store is not None:
            bus.subscribe("market_rule", lambda _d: self.reload_rules())
        if figures is not None:
            self.load_figures(figures.load_figures())

    # ---- providers: what the presence tells ------------------------------------------
    @contextmanager
    def _locks(self) -> Iterator[None]:
        """The presence's lock, then the market's: held by whatever reads both (the order
        is always this one, so that the dispatcher, which changes the presence under its
        lock and is heard here, and the market never wait on each other)."""
        with self.presence.lock, self._lock:
            yield

    def _session(self, provider_id: str) -> AgentSession | None:
        """The provider's session when it is online (the caller holds :meth:`_locks`)."""
        return self.presence.view().get(provider_id)

    def joining(self, session: AgentSession) -> None:
        """(:class:`~broker.jobs.presence.PresenceListener`) A session is about to be held:
        enter the provider with its builds (name -> version), advertised weights, memory,
        and the benchmarks and asks of its :class:`Offer`. Its stored asks (posted on an
        earlier connection, or loaded from the store at start) stand until it posts new
        ones, also for a plugin it dropped and serves again. The answers to the offer go to
        ``session.offer_replies`` (an ask refused: its previous valid ask stands)."""
        provider_id = session.provider_id
        plugins, digests = {}, {}
        for key, digest in session.plugins.items():
            name, _, version = key.partition("@")
            plugins[name] = version
            if digest:
                digests[name] = digest
        offer = session.offer
        session.offer = None  # read once, here
        replies: list[OfferReply] = []
        posted: list[str] = []
        self._reload_figures(provider_id)  # another replica may have measured it since
        self._links_ahead(provider_id, session.account_id)
        with self._locks():
            old = self._providers.get(provider_id)
            previous = self._stored_asks.get(provider_id, {})
            state = ProviderState(provider_id, session.account_id, plugins,
                                  float(session.vram_gb or 0.0),
                                  asks={p: a for p, a in previous.items() if p in plugins},
                                  digests=digests)
            if old is not None:
                state.cold_start_s = {p: s for p, s in old.cold_start_s.items() if p in plugins}
            self._providers[provider_id] = state
            self.book.withdraw(provider_id)
            current = self._session(provider_id)  # the session it replaces, if any
            if current is not None:
                state.queue_s = self._queue_s(state, current)
                state.posted_free = max(0, current.free)
            for plugin, units, cold in (offer.benchmarks if offer else ()):
                try:
                    self.report_benchmark(provider_id, plugin, units, cold_start_s=cold)
                    replies.append(OfferReply("benchmark", plugin))
                except (InvalidBenchmark, PluginNotServed) as exc:
                    replies.append(OfferReply("benchmark", plugin, exc))
            if current is not None:
                self._repost(state)
            for plugin, price in (offer.asks if offer else ()):
                try:
                    self._post_ask(provider_id, plugin, price)
                    replies.append(OfferReply("ask", plugin, price=price))
                    posted.append(plugin)
                except (InvalidAsk, PluginNotServed) as exc:
                    replies.append(OfferReply("ask", plugin, exc,
                                              price=state.asks.get(plugin, 0)))
        session.offer_replies = replies
        for plugin in posted:
            self._save_ask(provider_id, plugin)

    def joined(self, session: AgentSession) -> None:
        """(PresenceListener; the presence's lock is held) The session is held: its
        provider's asks enter the book with its free slots and queue."""
        with self._lock:
            state = self._providers.get(session.provider_id)
            if state is not None:
                state.queue_s = self._queue_s(state, session)
                state.posted_free = max(0, session.free)
                self._repost(state)

    def changed(self, session: AgentSession, moved: bool) -> None:
        """(PresenceListener; the presence's lock is held) The session's free slots or
        leases changed; ``moved``: a job came or went (its queue is re-posted at once)."""
        with self._lock:
            state = self._providers.get(session.provider_id)
            if state is not None:
                self._refresh_queue(state, session, force=moved)

    def left(self, session: AgentSession) -> None:
        """(PresenceListener) The provider's stream is no longer held here: out of the book
        (unless it reconnected meanwhile: the new session's asks stand)."""
        with self._locks():
            if self._session(session.provider_id) is None:
                self.book.withdraw(session.provider_id)
        self.flush_figures(session.provider_id)  # the replica it reconnects to reads them

    def tend(self, provider_id: str) -> None:
        """Re-read the provider's free slots from the presence and let its queue estimate
        follow the clock (the dispatcher calls it often for the sessions it tends)."""
        with self._locks():
            state = self._providers.get(provider_id)
            session = self._session(provider_id)
            if state is not None and session is not None:
                self._refresh_queue(state, session, force=False)

    def refresh(self, provider_id: str) -> None:
        """Re-read the provider's facts that come from hooks (``warm``) and re-post its
        asks: call it when a provider loads or evicts a model."""
        self._links_ahead(provider_id)
        with self._locks():
            state = self._providers.get(provider_id)
            if state is not None and self._session(provider_id) is not None:
                self._repost(state)

    def post_ask(self, provider_id: str, plugin: str, price_micro_per_unit: int) -> int:
        """Post or replace a standing ask; stored, so it outlives the connection and the
        broker. Raises :class:`InvalidAsk` or :class:`PluginNotServed`; the previous valid
        ask then stands."""
        self._links_ahead(provider_id)
        with self._locks():
            self._post_ask(provider_id, plugin, price_micro_per_unit)
        self._save_ask(provider_id, plugin)  # the store is written outside the clearing lock
        return price_micro_per_unit

    def _post_ask(self, provider_id: str, plugin: str, price_micro_per_unit: int) -> None:
        """:meth:`post_ask`'s checks and memory update: the caller holds the lock, and calls
        :meth:`_save_ask` once it released it."""
        state = self._providers.get(provider_id)
        if state is None or plugin not in state.plugins:
            served = sorted(state.plugins) if state else []
            raise PluginNotServed(
                f"ask for {plugin!r} refused: this agent serves {served}; post asks only "
                "for plugins listed in its capabilities")
        asks = [self._ask(state, plugin, price_micro_per_unit, digest)
                for digest in self._digests_of(state, plugin)]
        for ask in asks:
            validate_ask(ask, self.rules)  # all of them before touching the book
        for ask in asks:
            self.book.post(ask)
        state.asks[plugin] = price_micro_per_unit
        self._stored_asks.setdefault(provider_id, {})[plugin] = price_micro_per_unit

    def report_benchmark(self, provider_id: str, plugin: str, units_per_s: float,
                         cold_start_s: float | None = None) -> None:
        """Record the agent's claim, and the time its plugin host took to load the model
        (``cold_start_s``; None or 0: not measured). Raises :class:`InvalidBenchmark` for
        impossible values, recording neither."""
        limit = self.rules.max_throughput_units_per_s
        if (isinstance(units_per_s, bool) or not isinstance(units_per_s, (int, float))
                or not math.isfinite(units_per_s) or not 0 < units_per_s <= limit):
            raise InvalidBenchmark(
                f"benchmark for {plugin!r} refused: units_per_s must be a finite number above 0 "
                f"and at most {limit:g}; got {units_per_s!r}")
        cold_limit = self.rules.max_cold_start_s
        if cold_start_s is not None and (
                isinstance(cold_start_s, bool) or not isinstance(cold_start_s, (int, float))
                or not math.isfinite(cold_start_s) or not 0 <= cold_start_s <= cold_limit):
            raise InvalidBenchmark(
                f"benchmark for {plugin!r} refused: cold_start_s must be a finite number of "
                f"seconds from 0 to {cold_limit:g} (0: not measured); got {cold_start_s!r}")
        self._links_ahead(provider_id)
        with self._locks():
            state = self._providers.get(provider_id)
            if state is None or plugin not in state.plugins:
                raise PluginNotServed(f"benchmark for {plugin!r} refused: this agent does not "
                                      "serve it")
            self.tracker.claim(provider_id, plugin, float(units_per_s))
            self._dirty.add((provider_id, plugin))
            if cold_start_s:
                state.cold_start_s[plugin] = float(cold_start_s)
            self._repost(state)

    def admitted(self, spec: JobSpec) -> set[str]:
        """The providers that may take the job outside the auction (the cold market): the
        online ones serving the build with the pinned weights and at or above the
        reputation floor, or all of those when none is (the floor gives way, as in the
        auction). Capacity and exclusions are the dispatcher's to check."""
        with self._locks():
            serving = [pid for pid, s in self._providers.items()
                       if self._session(pid) is not None
                       and s.plugins.get(spec.plugin) == spec.plugin_version
                       and s.vram_gb >= spec.min_vram_gb
                       and (spec.weights_digest == ANY_WEIGHTS
                            or s.digests.get(spec.plugin) == spec.weights_digest)]
            floor = self.rules.reputation_floor
            good = {pid for pid in serving
                    if self.tracker.record_of(pid, spec.plugin).reliability >= floor}
            return good or set(serving)

    def operator_of(self, provider_id: str) -> str | None:
        """The operator (account) of a provider the market knows, else None."""
        with self._lock:
            state = self._providers.get(provider_id)
            return state.operator_id if state is not None else None

    # ---- canaries --------------------------------------------------------------------
    def canaries_due(self, provider_id: str) -> list[str]:
        """Plugins of this provider that need a canary now: never measured, or the last
        canary is older than ``canary_interval_s``; none while one is out."""
        now = self.clock()
        with self._locks():
            state = self._providers.get(provider_id)
            if state is None or self._session(provider_id) is None:
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
        with self._locks():
            self._canaries[canary.job_id] = canary
            self._last_canary[(canary.provider_id, canary.plugin)] = canary.sent_at
            self._dirty.add((canary.provider_id, canary.plugin))
            self._refresh_queue_of(canary.provider_id)

    def canary(self, job_id: str) -> Canary | None:
        with self._lock:
            return self._canaries.get(job_id)

    def has_canary(self, provider_id: str) -> bool:
        """Whether a canary is out to the provider (a handful are out at a time)."""
        with self._lock:
            return any(c.provider_id == provider_id for c in self._canaries.values())

    def canary_done(self, job_id: str) -> Canary | None:
        with self._locks():
            canary = self._canaries.pop(job_id, None)
            if canary is not None:
                self._refresh_queue_of(canary.provider_id)
            return canary

    def expired_canaries(self) -> list[Canary]:
        now = self.clock()
        with self._locks():
            gone = [c for c in self._canaries.values()
                    if now - c.sent_at > self.settings.canary_timeout_s]
            for c in gone:
                del self._canaries[c.job_id]
            for pid in {c.provider_id for c in gone}:
                self._refresh_queue_of(pid)
            return gone

    # ---- clearing --------------------------------------------------------------------
    def pinned_digest(self, plugin: str, version: str, job_pin: str | None = None) -> str:
        """The weights digest a job of this build must run on: the manifest's, else the
        job's own pin, else ``ANY_WEIGHTS`` (see :mod:`.builds`). Raises
        :class:`InvalidJob` for a job pin that is not a sha256 hex digest."""
        if job_pin is not None and job_pin != ANY_WEIGHTS and not is_sha256_hex(job_pin):
            raise InvalidJob("weights_digest", job_pin,
                             "64 lowercase hex digits (the weights' sha256 digest) or 'any'")
        pin = self._catalog_pin(plugin, version)
        if pin != ANY_WEIGHTS:
            return pin
        return job_pin or ANY_WEIGHTS

    def spec(self, *, plugin: str, version: str, work_units: float, client_id: str,
             priority: str = "standard", max_price_micro: int | None = None,
             deadline_s: float | None = None, n_slots: int = 1,
             excluded: frozenset[str] = frozenset(), job_id: str | None = None,
             weights_digest: str | None = None) -> JobSpec:
        """The auction's view of a job; ``weights_digest`` is the job's own pin, if any
        (the manifest's pin wins over it)."""
        manifest = self.manifest_of(plugin, version)
        return JobSpec(plugin=plugin, plugin_version=version,
                       min_vram_gb=float(getattr(manifest, "min_vram_gb", 0.0) or 0.0),
                       weights_digest=self.pinned_digest(plugin, version, weights_digest),
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
        passes: the job may queue until capacity appears. With replicas, the providers
        other replicas hold count too (as free, from the database: ``elsewhere``): a job
        one of them would take at its terms is admitted, one that none here nor there
        meets is refused, on whichever replica it is submitted."""
        try:
            self.clear(spec)
            return
        except NoEligibleProvider:
            refused = None
        except CannotMeetTerms as exc:
            refused = exc
        if self.elsewhere is not None:
            try:
                self.elsewhere.clear(spec)
                return  # a provider another replica holds meets the terms
            except NoEligibleProvider:
                pass
            except CannotMeetTerms as exc:
                refused = refused or exc
            except Exception:  # noqa: BLE001 - a database blip: judge on this replica's view
                log.exception("could not read the providers other replicas hold")
        if refused is not None:
            raise refused

    # ---- internals -------------------------------------------------------------------
    def _catalog_pin(self, plugin: str, version: str) -> str:
        key = (plugin, version)
        pin = self._pins.get(key)
        if pin is None:
            manifest = self.manifest_of(plugin, version)
            pin = builds.pinned_digest(manifest)
            if manifest is not None:  # versions are immutable once published
                self._pins[key] = pin
        return pin

    def _digests_of(self, state: ProviderState, plugin: str) -> list[str]:
        """The buckets the provider's ask for ``plugin`` goes in: its advertised weights,
        and ``ANY_WEIGHTS`` when the build pins none (jobs without a pin clear there)."""
        pin = self._catalog_pin(plugin, state.plugins[plugin])
        advertised = state.digests.get(plugin, "")
        if advertised in (ANY_WEIGHTS, NO_WEIGHTS):
            advertised = ""
        out = [ANY_WEIGHTS] if pin == ANY_WEIGHTS else []
        if advertised:
            out.append(advertised)
        elif pin != ANY_WEIGHTS:
            out.append(NO_WEIGHTS)
        return out

    def _cold_start_s(self, state: ProviderState, plugin: str) -> float:
        if self.warm(state.provider_id, plugin):
            return 0.0
        seconds = state.cold_start_s.get(plugin)
        if seconds is None:
            seconds = builds.manifest_cold_start_s(self.manifest_of(plugin,
                                                                    state.plugins[plugin]))
        if seconds is None:
            seconds = self.settings.default_cold_start_s
        return min(max(0.0, seconds), self.rules.max_cold_start_s)

    def _queue_s(self, state: ProviderState, session: AgentSession | None) -> float:
        """Expected seconds before the provider gets to a new job: the remaining expected
        time (W/θ less the time since it started) of each job (its session's leases) and
        canary it holds, over its slots (the slots work at once). A plugin without any θ
        counts nothing. (The caller holds :meth:`_locks`.)"""
        now = self.clock()
        pid = state.provider_id
        held: list[Lease | Canary] = list(session.leases.values()) if session else []
        held += [c for c in self._canaries.values() if c.provider_id == pid]
        thetas: dict[str, float] = {}  # one look-up per plugin, not per job held
        backlog = 0.0
        for h in held:
            theta = thetas.get(h.plugin)
            if theta is None:
                theta = thetas[h.plugin] = self.tracker.theta(pid, h.plugin)[0]
            if theta > 0:
                left = h.work_units / theta - max(0.0, now - h.since)
                if left > 0.0:  # (adding 0.0 would change nothing)
                    backlog += left
        slots = session.slots if session is not None else 1
        return min(backlog / max(1, slots), self.rules.max_queue_s)

    def _refresh_queue(self, state: ProviderState, session: AgentSession | None,
                       force: bool = True) -> None:
        """Re-post the provider's free slots when they changed, and its queue when it
        changed (a job or canary came or went: ``force``) or drifted with the clock by
        ``QUEUE_RESOLUTION_S`` or more (one update of the book for both). (The caller
        holds :meth:`_locks`.)"""
        changes: dict[str, int | float] = {}
        if session is not None:
            free = max(0, session.free)
            if state.posted_free != free:
                state.posted_free = free
                changes["slots_free"] = min(free, self.rules.max_slots)
        queue = self._queue_s(state, session)
        if queue != state.queue_s and (force or queue == 0
                                       or abs(queue - state.queue_s) >= QUEUE_RESOLUTION_S):
            state.queue_s = queue
            changes["queue_s"] = queue
        if changes and session is not None:
            self.book.update_provider(state.provider_id, **changes)

    def _refresh_queue_of(self, provider_id: str) -> None:
        """(the caller holds :meth:`_locks`)"""
        state = self._providers.get(provider_id)
        if state is not None:
            self._refresh_queue(state, self._session(provider_id))

    def _ask(self, state: ProviderState, plugin: str, price: int, digest: str) -> Ask:
        """(the caller holds :meth:`_locks`)"""
        theta, measured = self.tracker.theta(state.provider_id, plugin)
        theta = min(theta, self.rules.max_throughput_units_per_s)
        rec = self.tracker.record_of(state.provider_id, plugin)
        return Ask(provider_id=state.provider_id, operator_id=state.operator_id, plugin=plugin,
                   plugin_version=state.plugins[plugin], weights_digest=digest,
                   price_micro_per_unit=price, throughput_units_per_s=theta,
                   throughput_measured=measured, reliability=rec.reliability,
                   reputation=rec.reliability, queue_s=state.queue_s,
                   cold_start_s=self._cold_start_s(state, plugin),
                   slots_free=min(state.posted_free, self.rules.max_slots),
                   vram_gb=min(state.vram_gb, self.rules.max_vram_gb),
                   online=self._session(state.provider_id) is not None,
                   linked_accounts=self._linked(state.operator_id))

    def _links_ahead(self, provider_id: str, operator: str | None = None) -> None:
        """Read the links of the provider's operator before taking the locks: the read may
        go to the database (a cache miss), and under the locks it would hold up the
        presence; the asks re-posted under them then find the links cached."""
        operator = operator or self.operator_of(provider_id)
        if operator:
            self._linked(operator)

    def _linked(self, operator: str) -> frozenset[str]:
        try:
            return frozenset(self.linked_to(operator))
        except Exception:  # noqa: BLE001 - a link is a precaution: the ask stands without it
            log.exception("could not read the links of operator %s", operator)
            return frozenset()

    def _repost(self, state: ProviderState) -> None:
        """Re-file every ask of the provider with its current facts (the buckets may
        change too: a newly published manifest can pin weights). (The caller holds
        :meth:`_locks`.)"""
        session = self._session(state.provider_id)
        if session is not None:
            state.posted_free = max(0, session.free)
        asks = []
        for plugin in state.plugins:
            price = state.asks.get(plugin)
            if price is None:
                price = min(self.reserve_of(plugin), self.rules.max_ask_micro_per_unit)
            asks += [self._ask(state, plugin, price, d) for d in self._digests_of(state, plugin)]
        self.book.repost(state.provider_id, asks)

    def _save_ask(self, provider_id: str, plugin: str) -> None:
        """Write the provider's current ask for ``plugin`` to the store. Called without the
        clearing lock; saves are serialised and each writes the price standing when it
        runs, so the store ends with the last price posted whatever the threads' order."""
        if self.store is None:
            return
        try:
            with self._save_lock:
                with self._lock:
                    price = self._stored_asks.get(provider_id, {}).get(plugin)
                if price is not None:
                    self.store.save_ask(provider_id, plugin, price, self.clock())
        except Exception:  # noqa: BLE001 - the ask stands in memory; the agent re-posts it
            log.exception("could not store the ask of %s for %s; it stands until the broker "
                          "restarts", provider_id, plugin)


