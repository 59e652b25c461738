"""ProviderPresence: the agents whose streams this broker replica holds, kept once.

One object per replica, built in the wiring (``broker.services.build_services``) and given to
the dispatcher (docs/architecture.md, *Replicas*). Per provider it holds the connected
:class:`AgentSession`: its slots, the jobs it holds (``active``), drain, pause, owner's
unavailability and quota factor; and an index of who serves which build, so that placing a
job looks only at the agents that could run it, however many others are connected. A
provider not held here may be held by another replica: commands for it travel on the bus.

``lock`` guards the sessions, their slots and leases, and the index; the dispatcher's
condition is built on the same lock, so that a slot taken or freed and the session it belongs
to change together.

The market (:class:`broker.market.MarketService`) keeps no copy of any of this: it is given
the presence at construction, listens to it (:class:`PresenceListener`) and reads who is
connected, free slots and leases from here. Lock order: ``presence.lock`` first, then the
market's lock, never the other way (the listener is called with ``presence.lock`` held, or
takes it before its own).

Which replica holds each stream is written through to ``streams`` (the replica registry,
:class:`broker.replicas.service.ReplicaRegistry`) as a session comes and goes, and
:meth:`ProviderPresence.held_elsewhere` is the one read of the streams other live replicas
hold (admission's market of the others, the weights defaults).
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Protocol

from .model import Job

log = logging.getLogger(__name__)


# Assignments a thread sends while it gathers (a dispatcher pass, :func:`assignments_gathered`):
# the sessions it sent some to, flushed as the pass ends.
_gathering = threading.local()
GATHER_SCAN_S = 0.002


@contextmanager
def assignments_gathered() -> Iterator[None]:
    """Within the block, assignments this thread sends an agent whose session gathers them
    (the gateway's, for an agent that takes AssignmentBatch) are held, and each agent's go
    out as the block ends in one message (issue #28). A session also sends what it holds
    before any other message to the agent and once it holds ``GATHER_MAX`` or the first
    has waited ``GATHER_MAX_WAIT_S``, so that order and latency keep their bounds. Other
    threads' sends are never held. Nested blocks are one block."""
    if getattr(_gathering, "sessions", None) is not None:
        yield
        return
    _gathering.sessions = {}
    try:
        yield
    finally:
        sessions, _gathering.sessions = _gathering.sessions, None
        for session in sessions.values():
            try:
                session.flush_assignments()
            except Exception:  # noqa: BLE001 - a dead stream: the lease reaper requeues
                log.exception("sending the assignments held for %s failed",
                              session.provider_id)


def gathering(session: "AgentSession") -> bool:
    """True (and ``session`` is flushed as the block ends) when this thread is inside
    :func:`assignments_gathered`: the session may hold the assignment it is sending. The
    other sessions this pass holds assignments for send them if the first has waited its
    bound (:meth:`AgentSession.flush_if_due`; looked at every ``GATHER_SCAN_S``), so that a
    job held for one agent does not wait while the pass places many on others."""
    sessions = getattr(_gathering, "sessions", None)
    if sessions is None:
        return False
    now = time.monotonic()
    if now - getattr(_gathering, "scanned_at", 0.0) >= GATHER_SCAN_S:
        _gathering.scanned_at = now
        for other in sessions.values():
            if other is not session:
                other.flush_if_due()
    sessions[id(session)] = session
    return True


@dataclass(frozen=True)
class Lease:
    """A job a provider holds (matched or running): what the market's queue estimate needs
    of it (its part of the provider's backlog)."""
    plugin: str
    work_units: float
    since: float


@dataclass(frozen=True)
class Offer:
    """What an agent offers the market with its connection, read once when the market hears
    it joined: its benchmarks (plugin, units/s, cold start s or None) and standing asks
    (plugin, micro-credits per unit)."""
    benchmarks: tuple[tuple[str, float, float | None], ...] = ()
    asks: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class OfferReply:
    """The market's answer to one part of an :class:`Offer`: ``kind`` "benchmark" or
    "ask"; ``error`` the refusal (None: accepted); ``price`` the price standing after it."""
    kind: str
    plugin: str
    error: Exception | None = None
    price: int = 0


@dataclass(eq=False)
class AgentSession:
    """A connected agent as the dispatcher sees it. The gateway subclasses it to send."""

    provider_id: str
    public_key: str
    account_id: str
    plugins: dict[str, str]          # "name@version" -> weights digest
    slots: int = 1
    active: set[str] = field(default_factory=set)
    draining: bool = False
    paused: bool = False
    # The agent said it takes no work now (its owner's terms: idle-only, schedule,
    # limits, issue #26): the state it gave, "" while it takes work. Like a drain it gets
    # no new jobs; unlike a drain it comes back.
    unavailable: str = ""
    # How many times it said so on this session: a canary it gives back for its owner must
    # come after one (broker.market.canary.CanaryService.withdrawn)
    unavailable_reports: int = 0
    quota_factor: float = 1.0        # cut by lost verification disputes (DESIGN §6)
    # "name@version" -> the reproducibility class it declared at connect for the build
    # ({"hardware_class", "dtype"}): recorded in each envelope it gets (broker.jobs.repro)
    classes: dict[str, dict[str, str]] = field(default_factory=dict)
    resumed: dict[str, Job] = field(default_factory=dict)  # jobs it held when it connected
    # The jobs (not canaries) among ``active``, with what the market's queue estimate needs
    leases: dict[str, Lease] = field(default_factory=dict)
    vram_gb: float = 0.0  # the memory a model runs in (the GPU's; the host's on a CPU)
    offer: Offer | None = None  # read once by the market when it hears the session joined
    offer_replies: list[OfferReply] = field(default_factory=list)  # and its answers

    def serves(self, job: Job) -> bool:
        """It serves the job's plugin version, on the pinned weights if the job pins any."""
        key = f"{job.plugin}@{job.plugin_version}"
        if key not in self.plugins:
            return False
        return not job.weights_digest or self.plugins[key] == job.weights_digest

    @property
    def free(self) -> int:
        if self.draining or self.paused or self.unavailable:
            return 0
        return max(1, int(self.slots * self.quota_factor)) - len(self.active)

    def send_assignment(self, envelope_bytes: bytes, signature: str) -> None:
        raise NotImplementedError

    def flush_assignments(self) -> None:
        """Send the assignments held while a pass gathered them (none here: a session that
        does not gather sends each at once)."""

    def flush_if_due(self) -> None:
        """Send the held assignments if the first has waited its bound (none here)."""

    def send_cancel(self, job_id: str, attempt: int, reason: str) -> None:
        raise NotImplementedError


class Streams(Protocol):
    """Where the broker records which replica holds each agent's stream."""

    def hold(self, provider_id: str) -> None: ...
    def release(self, provider_id: str) -> None: ...
    def held_elsewhere(self) -> dict[str, str]: ...


class PresenceListener(Protocol):
    """Who hears of sessions coming, changing and going (the market). ``joining`` is called
    before the session is held (without :attr:`ProviderPresence.lock`: it may read the
    database), ``joined`` and ``changed`` with the lock held, ``left`` after the session was
    forgotten, without the lock."""

    def joining(self, session: AgentSession) -> None: ...
    def joined(self, session: AgentSession) -> None: ...
    def changed(self, session: AgentSession, moved: bool) -> None: ...
    def left(self, session: AgentSession) -> None: ...


class ProviderPresence:
    """The sessions held here (provider id -> :class:`AgentSession`) and who serves what.
    ``streams``: where the streams held are recorded for the other replicas (None: this
    process is the whole broker, nobody else holds any)."""

    def __init__(self, streams: Streams | None = None) -> None:
        self.streams = streams
        self.lock = threading.RLock()
        self._sessions: dict[str, AgentSession] = {}
        self._serving: dict[str, set[str]] = {}  # "name@version" -> provider ids
        self._listeners: list[PresenceListener] = []

    def listen(self, listener: PresenceListener) -> None:
        """Tell ``listener`` of every session from now on (the market calls it when it is
        built on this presence)."""
        with self.lock:
            self._listeners.append(listener)

    def add(self, session: AgentSession) -> bool:
        """Hold ``session``, replacing the provider's previous one (whose jobs it keeps);
        returns whether the provider was not held here before. Call it without holding
        :attr:`lock`: the listeners prepare for it and the stream is recorded in the
        database outside it."""
        pid = session.provider_id
        for listener in list(self._listeners):
            listener.joining(session)
        with self.lock:
            old = self._sessions.get(pid)
            self._sessions[pid] = session
            if old is not None:
                session.active |= old.active
                session.leases = {**session.leases, **old.leases}
                self._unserve(old)
            for build in session.plugins:
                self._serving.setdefault(build, set()).add(pid)
            for listener in self._listeners:
                listener.joined(session)
        if self.streams is not None:
            try:
                self.streams.hold(pid)
            except Exception:  # noqa: BLE001 - it works here; other replicas miss it
                log.exception("could not record that this replica holds %s", pid)
        return old is None

    def remove(self, session: AgentSession) -> bool:
        """Forget ``session`` if it is still the provider's current one; returns whether
        it was (a replaced session's stream closing changes nothing). Call it without
        holding :attr:`lock`, as :meth:`add`."""
        pid = session.provider_id
        with self.lock:
            if self._sessions.get(pid) is not session:
                return False
            del self._sessions[pid]
            self._unserve(session)
        for listener in list(self._listeners):
            listener.left(session)
        if self.streams is not None and self.get(pid) is None:  # not back meanwhile
            self.streams.release(pid)
            if self.get(pid) is not None:  # back between the look and the release: its
                self.streams.hold(pid)     # hold may have landed first; record it again
        return True

    # ---- slots and leases (the one record of them) ------------------------------------
    def take(self, session: AgentSession, job_id: str, lease: Lease | None = None) -> bool:
        """Take one of ``session``'s free slots for ``job_id`` (``lease``: a job's, for the
        queue estimate; None: a canary's, which the market times itself); False when it has
        none free or is no longer the provider's session held here (its stream was
        replaced or closed: what is sent on it goes nowhere)."""
        with self.lock:
            if self._sessions.get(session.provider_id) is not session or session.free <= 0:
                return False
            session.active.add(job_id)
            if lease is not None:
                session.leases[job_id] = lease
            self._changed(session, moved=lease is not None)
            return True

    def lease(self, session: AgentSession, job_id: str, lease: Lease) -> None:
        """Record what a job ``session`` already holds is (found held when it connects)."""
        with self.lock:
            if job_id in session.leases:
                return
            session.active.add(job_id)
            session.leases[job_id] = lease
            self._changed(session, moved=True)

    def give_back(self, session: AgentSession, job_id: str) -> None:
        """``session``'s slot for ``job_id`` is free again, and so is it in the session
        held now for that provider: a session that replaced ``session`` took its jobs over
        (:meth:`add`), and an answer read on the old stream frees the slot in both."""
        with self.lock:
            held = self._sessions.get(session.provider_id)
            for s in {id(x): x for x in (session, held) if x is not None}.values():
                s.active.discard(job_id)
                moved = s.leases.pop(job_id, None) is not None
                self._changed(s, moved=moved)

    def release(self, provider_id: str | None, job_id: str) -> AgentSession | None:
        """The provider's slot for ``job_id`` is free; returns its session, None when its
        stream is not held here."""
        with self.lock:
            session = self.get(provider_id)
            if session is not None:
                self.give_back(session, job_id)
            return session

    def set_paused(self, provider_id: str | None, paused: bool) -> AgentSession | None:
        """Pause (no new jobs) or resume the provider held here; None when it is not."""
        with self.lock:
            session = self.get(provider_id)
            if session is not None:
                session.paused = paused
                self._changed(session, moved=False)
            return session

    def set_quota(self, provider_id: str | None, factor: float) -> AgentSession | None:
        """Set the concurrency quota factor of the provider held here; None when it is not."""
        with self.lock:
            session = self.get(provider_id)
            if session is not None:
                session.quota_factor = float(factor)
                self._changed(session, moved=False)
            return session

    def changed(self, session: AgentSession) -> None:
        """Something about ``session`` its capacity depends on changed (it drains, its owner
        made it unavailable, a canary took or freed a slot): the listeners re-read it."""
        with self.lock:
            if self._sessions.get(session.provider_id) is session:
                self._changed(session, moved=False)

    def _changed(self, session: AgentSession, moved: bool) -> None:
        """(the caller holds the lock) ``moved``: a job came or went."""
        if self._sessions.get(session.provider_id) is not session:
            return  # not held (yet, or any more): nobody reads it
        for listener in self._listeners:
            listener.changed(session, moved)

    def _unserve(self, session: AgentSession) -> None:
        """(the caller holds the lock)"""
        for build in session.plugins:
            ids = self._serving.get(build)
            if ids is not None:
                ids.discard(session.provider_id)
                if not ids:
                    del self._serving[build]

    def get(self, provider_id: str | None) -> AgentSession | None:
        """The provider's session if its stream is held here, else None."""
        if not provider_id:
            return None
        with self.lock:
            return self._sessions.get(provider_id)

    def sessions(self) -> list[AgentSession]:
        with self.lock:
            return list(self._sessions.values())

    def ids(self) -> list[str]:
        with self.lock:
            return list(self._sessions)

    def count(self) -> int:
        """How many agents are held here (without copying the sessions)."""
        return len(self._sessions)

    def serving(self, plugin: str, version: str) -> bool:
        """Whether an agent held here serves ``plugin@version`` (one look-up in the index:
        asked on every submit)."""
        with self.lock:
            return bool(self._serving.get(f"{plugin}@{version}"))

    def serving_sessions(self, job: Job) -> dict[str, AgentSession]:
        """The sessions held here that serve ``job``'s plugin build (any weights)."""
        with self.lock:
            ids = self._serving.get(f"{job.plugin}@{job.plugin_version}", ())
            return {pid: self._sessions[pid] for pid in ids if pid in self._sessions}

    def held_elsewhere(self) -> dict[str, str]:
        """provider id -> replica id of the streams other live replicas hold now."""
        return self.streams.held_elsewhere() if self.streams is not None else {}

    def any_free(self) -> bool:
        with self.lock:
            return any(s.free > 0 for s in self._sessions.values())

    def view(self) -> dict[str, AgentSession]:
        """The live mapping itself, for a caller that holds :attr:`lock` and only reads."""
        return self._sessions
