"""Dispatcher: matches queued jobs to connected agents with free slots, and reaps leases.

Matching is push: a job is handed to an agent the moment both exist (a new job wakes the
dispatcher; so does a freed slot or a new agent). The policy here is the spine's: any agent
that serves the plugin version, least loaded first, ties broken at random, avoiding
providers that already failed the job while others can take it. With a market attached
(``dispatcher.market``, a :class:`broker.market.MarketService`) each job clears in the
auction instead (DESIGN §4): the winner is leased the job at its clearing price, and the
queued siblings of a split batch clear together (K slots at the (K+1)-th score, on
different operators where possible). Without a market, ``_choose`` keeps the spine's rule.
"""
from __future__ import annotations

import json
import logging
import random
import threading
import time
from typing import TYPE_CHECKING, Callable

from broker.auction.errors import NoMatch

from .model import Job, JobState, job_from_wire, job_to_wire
from .ports import StakeCheck
from .presence import AgentSession, Lease, ProviderPresence, assignments_gathered
from .service import JobService

if TYPE_CHECKING:
    from broker.market.service import MarketService
    from broker.replicas.bus import ReplicaBus

log = logging.getLogger(__name__)

# Tending a session (the market re-reads its free slots from the presence and lets its queue
# follow the clock; the canaries due to it are sent):
# up to TEND_ALL_UP_TO sessions, every matching pass tends each; beyond, a pass tends the
# sessions that changed or hold jobs and a slice of the others, so that each is tended at
# least every TEND_PERIOD_S and a pass costs the same with 10,000 idle agents as with 10.
TEND_ALL_UP_TO = 64
WIRE_JOB_MAX = 6_000  # characters of JSON: a larger queued job travels as its id only
TEND_PERIOD_S = 10.0


class Dispatcher:
    def __init__(self, jobs: JobService, *, reap_interval_s: float = 0.5,
                 rng: random.Random | None = None, bus: ReplicaBus | None = None,
                 presence: ProviderPresence | None = None,
                 market: MarketService | None = None,
                 canary_sender: Callable[[AgentSession], None] | None = None,
                 quota: Callable[[str], float] | None = None,
                 needs_download: Callable[[str, Job], bool] | None = None,
                 on_left: Callable[[str], None] | None = None,
                 stakes: StakeCheck | None = None):
        """``presence``: the agents whose streams this replica holds (shared with whoever else
        reads them: a ``market`` must be built on the same one; None: the market's, else a
        fresh one). ``bus``: the other broker replicas
        (docs/architecture.md, *Replicas*): jobs queued here that no agent here took wake
        their dispatchers, and a command for an agent whose stream another replica holds
        (cancel, a freed slot, pause, quota) travels there; None: this process is the whole
        broker. ``market`` (broker.market.MarketService): each job clears in its auction;
        None: least-loaded matching. ``canary_sender(session)`` sends the canaries due to an
        agent with a free slot. ``quota(provider_id)``: the concurrency quota factor lost
        disputes left a provider (DESIGN §6; None: 1). ``needs_download(provider_id, job)``:
        whether the provider would first have to download something the job names (an
        adapter it has not installed, issue #3); such providers are avoided while one that
        holds everything can take the job. ``on_left(provider_id)``: an agent's stream ended
        (broker.providers.presence: it was seen until now). ``stakes``: whether a provider
        holds a plugin's minimum stake (verification, DESIGN §6; None: every provider does).
        The job service tells the dispatcher what it places (:meth:`queued`,
        :meth:`released`, :meth:`cancel`, :meth:`second_opinion`) once the wiring joins it
        to the job service's events (``JobEventRelay.join_placement``)."""
        self.jobs = jobs
        self.bus = bus
        self.reap_interval_s = reap_interval_s
        self.rng = rng or random.Random()
        if market is not None and presence is not None and market.presence is not presence:
            raise ValueError("the dispatcher and its market must share one ProviderPresence "
                             "(build the market with presence=..., the dispatcher's)")
        # (with a market and no presence given: the market's, the one record of both)
        self.presence = presence or (market.presence if market is not None
                                     else ProviderPresence())
        self._due: set[str] = set()    # sessions to tend on the next pass (they changed)
        self._busy: set[str] = set()   # sessions holding jobs (their queue estimate moves)
        self._ring: list[str] = []     # every session, in the order the slices visit them
        self._ring_at = 0
        self._owed = 0.0
        self._tended_at = self._busy_tended_at = time.monotonic()
        # On the presence's lock: a slot taken or freed changes with its session.
        self._cond = threading.Condition(self.presence.lock)
        self._kicked = True
        self._stop = False
        self._thread: threading.Thread | None = None
        # True while queued jobs may be waiting for a slot: then a new job must queue
        # behind them instead of being handed out directly (first come, first served).
        self._backlog = True
        # The queued jobs this process knows of (submitted or requeued here), oldest first,
        # so that matching does not re-read the whole queue from the database on every
        # freed slot. The database stays the truth: the queue is re-read from it every
        # ``reap_interval_s`` (jobs queued by another replica, delayed checks coming due,
        # jobs cancelled while queued), and a job that moved meanwhile fails its
        # conditional assignment and is dropped.
        self._pending: dict[str, Job] = {}
        self._pending_sorted = True
        self._added: dict[str, int] = {}  # job id -> _stamp when it was added in memory
        self._stamp = 0
        self._scanned_at = float("-inf")
        self._remote: set[str] = set()  # ids of jobs other replicas queued (to read)
        self.market = market
        self.canary_sender = canary_sender
        self.quota = quota or (lambda provider_id: 1.0)
        self.needs_download = needs_download or (lambda provider_id, job: False)
        # Verification (DESIGN §6): whether a provider may take a plugin's jobs (it holds
        # the plugin's minimum stake).
        self.eligible = (stakes.stake_ok if stakes is not None
                         else (lambda provider_id, plugin: True))
        self.on_left = on_left or (lambda provider_id: None)
        if bus is not None:
            bus.subscribe("queued", self._queued_elsewhere)
            bus.subscribe("released", lambda d: self._released_here(d.get("p"), d.get("j")))
            bus.subscribe("cancel", self._cancel_here)
            bus.subscribe("paused", lambda d: self._paused_here(d.get("p"), bool(d.get("v"))))
            bus.subscribe("quota", lambda d: self._quota_here(d.get("p"), d.get("f")))
            bus.on_gap(self.rescan)

    # ---- sessions --------------------------------------------------------------------
    def register(self, session: AgentSession) -> None:
        try:
            session.quota_factor = self.quota(session.provider_id)
        except Exception:  # noqa: BLE001 - a DB blip: full quota until the next change
            log.exception("could not read the quota of %s", session.provider_id)
        pid = session.provider_id
        with self._cond:
            if not self.presence.count():  # it kept no queue in memory meanwhile: read it now
                self._scanned_at = float("-inf")
        if self.market is not None:
            self._lease_resumed(session)
        session.resumed = {}  # read once, here: not kept for the whole connection
        # Held from now on; the market hears of it from the presence (it joins the book).
        new = self.presence.add(session)
        with self._cond:
            if new:
                self._ring.append(pid)
            self._due.add(pid)
        self._sync(session)
        self.kick()

    def _lease_resumed(self, session: AgentSession) -> None:
        """Jobs an agent still holds when it (re)connects, e.g. after a broker restart, are
        leases of its session (before it is held), so that they count in its queue as the
        market estimates it. A lease its previous session held here is kept as it was."""
        before = self.presence.get(session.provider_id)
        known = before.leases if before is not None else {}
        for job_id in list(session.active):
            if job_id in known or job_id in session.leases:
                continue
            try:
                job = session.resumed.get(job_id) or self.jobs.repo.get(job_id)
            except Exception:  # noqa: BLE001 - only the queue estimate is at stake
                log.exception("could not read resumed job %s", job_id)
                continue
            if job is not None and job.provider_id == session.provider_id:
                since = job.started_at or job.matched_at
                self.presence.lease(session, job.id, Lease(
                    job.plugin, float(job.work_units),
                    self.market.clock() if since is None else since))

    def changed(self, session: AgentSession) -> None:
        """Something about ``session`` that the market sees changed (e.g. it drains): it
        is tended on the next pass."""
        with self._cond:
            self._due.add(session.provider_id)
        self.kick()

    def unregister(self, session: AgentSession) -> None:
        gone = self.presence.remove(session)  # the market hears of it (out of the book)
        if gone:
            with self._cond:
                self._busy.discard(session.provider_id)
        if gone:
            self.on_left(session.provider_id)

    def session(self, provider_id: str) -> AgentSession | None:
        return self.presence.get(provider_id)

    def sessions(self) -> list[AgentSession]:
        return self.presence.sessions()

    def session_count(self) -> int:
        """How many agents are connected (without copying the sessions)."""
        return self.presence.count()

    def set_paused(self, provider_id: str, paused: bool) -> bool:
        """Pause (no new jobs; running ones finish) or resume a connected provider; False
        when it is not connected here (its stored status applies when it connects; a
        replica holding its stream applies it now)."""
        here = self._paused_here(provider_id, paused)
        if not here and self.bus is not None:
            self.bus.publish("paused", {"p": provider_id, "v": int(paused)})
        return here

    def _paused_here(self, provider_id, paused: bool) -> bool:
        with self._cond:
            s = self.presence.set_paused(provider_id, paused)
            if s is not None:
                self._due.add(provider_id)
        if s is not None and not paused:
            self.kick()
        return s is not None

    def set_quota(self, provider_id: str, factor: float) -> None:
        """A lost dispute cut the provider's concurrency quota (applies to new jobs)."""
        if not self._quota_here(provider_id, factor) and self.bus is not None:
            self.bus.publish("quota", {"p": provider_id, "f": factor})

    def _quota_here(self, provider_id, factor) -> bool:
        if not isinstance(factor, (int, float)):
            return False
        return self.presence.set_quota(provider_id, factor) is not None

    def second_opinion(self, job: Job, provider_id: str) -> str | None:
        """``provider_id``'s operator when a provider of another operator (not excluded
        from ``job``) is connected and serves it; else None (JobService._input_refused)."""
        with self._cond:
            own = self.presence.get(provider_id)
            sessions = self.presence.sessions()
        if own is None or not any(s.account_id != own.account_id and s.serves(job)
                                  and not s.draining and not _checked_operator(job, s)
                                  for s in sessions):
            return None
        return own.account_id

    def released(self, provider_id: str | None, job_id: str) -> None:
        if not self._released_here(provider_id, job_id) and provider_id and self.bus:
            self.bus.publish("released", {"p": provider_id, "j": job_id})

    def _released_here(self, provider_id, job_id) -> bool:
        """The provider's slot for ``job_id`` is free; False: its stream is not here."""
        with self._cond:
            # (the market hears of the slot it freed and the queue it left from the presence)
            s = self.presence.release(provider_id, job_id)
            if s is not None:
                self._due.add(provider_id)  # a freed slot may take a canary due
        self.kick()
        return s is not None

    def cancel(self, job: Job) -> None:
        reason = job.error_message or "cancelled"
        if not self._send_cancel(job.provider_id, job.id, job.attempt, reason) \
                and job.provider_id and self.bus is not None:
            self.bus.publish("cancel", {"p": job.provider_id, "j": job.id, "a": job.attempt,
                                        "r": reason})

    def _cancel_here(self, data: dict) -> None:
        if isinstance(data.get("a"), int):
            self._send_cancel(data.get("p"), data.get("j"), data["a"], str(data.get("r", "")))

    def _send_cancel(self, provider_id, job_id, attempt: int, reason: str) -> bool:
        """Tell the agent to stop ``job_id`` if its stream is here."""
        s = self.session(provider_id) if provider_id else None
        if s is not None:
            try:
                s.send_cancel(job_id, attempt, reason)
            except Exception:  # noqa: BLE001 - a dead stream must not stop a cancel
                log.exception("could not send cancel for %s", job_id)
        return s is not None

    def _queued_elsewhere(self, data: dict) -> None:
        """Another replica queued jobs no agent there took: read them on the next pass
        (if any agent is connected here to take them)."""
        ids = [i for i in data.get("j") or () if isinstance(i, str)]
        if not ids or not self.presence.count():
            return
        job = None
        if data.get("c") is not None:
            try:
                job = job_from_wire(data["c"])
            except (KeyError, TypeError, ValueError):
                job = None  # read back instead
        with self._cond:
            if job is not None and job.id in ids and job.id not in self._pending:
                self._add_pending(job)
                ids = [i for i in ids if i != job.id]
            self._remote.update(ids)
        self.kick()

    def _add_pending(self, job: Job) -> None:
        """(the caller holds the lock)"""
        last = next(reversed(self._pending.values()), None)
        if last is not None and (last.created_at, last.id) > (job.created_at, job.id):
            self._pending_sorted = False
        self._pending[job.id] = job
        self._stamp += 1
        self._added[job.id] = self._stamp

    def rescan(self) -> None:
        """Read the whole queue again on the next pass (wake-ups may have been lost)."""
        self._scanned_at = float("-inf")
        self.kick()

    def queued(self, job: Job, siblings: list[Job] | None = None) -> None:
        """A job was queued: hand it out at once from the caller's thread when nothing is
        waiting ahead of it (saves a thread hop and a queue scan); else wake the loop.
        ``siblings``: jobs queued together, ``job`` first: a split request's (they clear
        together) or a bulk request's (``POST /v1/jobs/bulk``), one wake-up for all."""
        if job.not_before is not None and job.not_before > time.time():
            return  # a delayed check: the loop offers it once its time comes
        if not self._backlog and not job.batch_id and not siblings:
            if self._place(job):
                return
        if self.bus is not None and self.bus.shared and not self.presence.count():
            # No agent here to take it: the replicas holding agents are told; this one
            # reads the queue from the database once an agent connects.
            self._tell_queued(siblings or [job])
            return
        jobs = siblings or [job]
        if job.batch_id and not siblings:  # a requeued sibling: with its queued siblings
            try:
                jobs = [j for j in self.jobs.repo.batch(job.batch_id)
                        if j.state is JobState.QUEUED] or [job]
            except Exception:  # noqa: BLE001 - the next queue read finds them
                log.exception("could not read the siblings of batch %s", job.batch_id)
        with self._cond:
            for j in jobs:
                last = next(reversed(self._pending.values()), None)
                if last is not None and (last.created_at, last.id) > (j.created_at, j.id):
                    self._pending_sorted = False  # a requeued job goes back to its place
                self._pending[j.id] = j
                self._stamp += 1
                self._added[j.id] = self._stamp
        if self.bus is not None and self.bus.shared:  # agents on other replicas may take them
            self._tell_queued(jobs)
        self.kick()

    def _tell_queued(self, jobs: list[Job]) -> None:
        """Wake the other replicas' dispatchers; a single small job travels whole (they
        need not read it back), else its id."""
        message: dict = {"j": [j.id for j in jobs]}
        if len(jobs) == 1:
            wire = job_to_wire(jobs[0])
            try:
                if len(json.dumps(wire, separators=(",", ":"))) <= WIRE_JOB_MAX:
                    message["c"] = wire
            except (TypeError, ValueError):
                pass
        self.bus.publish("queued", message)

    def _queue_snapshot(self, limit: int = 256) -> list[Job]:
        """The oldest queued jobs, from memory; from the database every reap interval."""
        now = time.monotonic()
        with self._cond:
            remote, self._remote = self._remote, set()
        if len(remote) > 32:  # many: one read of the queue is cheaper than one per job
            self._scanned_at = float("-inf")
        elif remote:
            self._read_remote(remote)
        if now - self._scanned_at >= self.reap_interval_s:
            with self._cond:
                before = self._stamp
            fresh = self.jobs.queued(limit=limit)
            with self._cond:
                self._scanned_at = now
                # The database is the truth as of the read (a job cancelled or assigned
                # meanwhile is gone); jobs added in memory since the read began are kept.
                newer = {i: j for i, j in self._pending.items() if self._added.get(i, 0) > before}
                self._pending = {j.id: j for j in fresh}
                self._pending.update(newer)
                self._added = {i: self._added[i] for i in newer}
                self._pending_sorted = False
        with self._cond:
            if not self._pending_sorted:
                self._pending = dict(sorted(self._pending.items(),
                                            key=lambda kv: (kv[1].created_at, kv[0])))
                self._pending_sorted = True
            out = []
            for job in self._pending.values():
                out.append(job)
                if len(out) >= limit:
                    break
            return out

    def _read_remote(self, ids: set[str]) -> None:
        """Add the jobs another replica queued (still queued, not known here yet)."""
        with self._cond:
            ids = {i for i in ids if i not in self._pending}
        for job_id in ids:
            try:
                job = self.jobs.repo.get(job_id)
            except Exception:  # noqa: BLE001 - the next full read of the queue finds it
                log.exception("could not read job %s queued by another replica", job_id)
                continue
            if job is None or job.state is not JobState.QUEUED or (
                    job.not_before is not None and job.not_before > time.time()):
                continue
            with self._cond:
                self._add_pending(job)

    def _forget(self, job_ids) -> None:
        with self._cond:
            for job_id in job_ids:
                self._pending.pop(job_id, None)
                self._added.pop(job_id, None)

    def _sync(self, session: AgentSession) -> None:
        """Let the market re-read the agent's free slots from the presence (draining, its
        owner's terms and canaries change them without a word to it) and its queue
        estimate follow the clock."""
        if self.market is not None:
            self.market.tend(session.provider_id)

    def _assign(self, job: Job, session: AgentSession, price: int | None = None) -> bool:
        # The lease is taken before the envelope goes (a fast job may end at once); the
        # market hears of it from the presence, in the same update of its book.
        lease = Lease(job.plugin, float(job.work_units),
                      self.market.clock() if self.market is not None else time.time())
        with self._cond:
            if not self.presence.take(session, job.id, lease):
                return False
            self._busy.add(session.provider_id)
        try:
            moved = self.jobs.assign(job, session, price_micro_per_unit=price)
        except Exception:  # noqa: BLE001 - a dead stream: the lease reaper requeues
            log.exception("assignment of %s to %s failed", job.id, session.provider_id)
            moved = None
        if moved is None:
            with self._cond:
                self.presence.give_back(session, job.id)
                # Assigned elsewhere, cancelled, or an attempt moved on: not queued as seen.
                self._pending.pop(job.id, None)
                self._added.pop(job.id, None)
            return False
        return True

    def _place(self, job: Job, queued: list[Job] | None = None) -> list[str]:
        """Assign ``job`` (with its queued siblings when it belongs to a split batch);
        returns the ids of the jobs assigned."""
        if self.market is None:
            session = self._choose(job)
            return [job.id] if session is not None and self._assign(job, session) else []
        siblings = [job]
        if job.batch_id:
            pool = queued if queued is not None else self.jobs.queued(limit=256)
            siblings = sorted({j.id: j for j in [job, *pool] if j.batch_id == job.batch_id}
                              .values(), key=lambda j: j.batch_index)
        return [sibling.id for sibling, session, price in self._clear(siblings)
                if self._assign(sibling, session, price)]

    def _clear(self, jobs: list[Job]) -> list[tuple[Job, AgentSession, int]]:
        """Clear ``jobs`` (one job, or siblings of one split) in the auction: the winners'
        sessions and clearing prices, best first. Providers that already failed a job are
        avoided while others can take it."""
        first = jobs[0]
        excluded = frozenset().union(*(j.excluded_providers for j in jobs))
        caps = [j.max_price_micro for j in jobs]
        sessions = self.presence.serving_sessions(first)
        # Providers short of the plugin's minimum stake never bid; a check never runs on
        # the operator it checks (hard), other exclusions are soft (failed it before).
        barred = frozenset(p for p, s in sessions.items()
                           if not self.eligible(p, first.plugin) or _checked_operator(first, s))
        hard = barred | (excluded if first.check_of else frozenset())
        cold = frozenset(p for p in sessions if self.needs_download(p, first))
        tries = [excluded | hard, hard] if excluded - hard else [hard]
        if cold and cold != frozenset(sessions):  # warm ones first, the others if need be
            tries = [t | cold for t in tries] + tries
        for avoid in tries:
            spec = self.market.spec(
                plugin=first.plugin, version=first.plugin_version, work_units=first.work_units,
                client_id=first.account_id, priority=first.priority,
                max_price_micro=sum(caps) if all(c > 0 for c in caps) else None,
                n_slots=len(jobs), excluded=avoid, job_id=first.id,
                weights_digest=getattr(first, "weights_digest", None))
            try:
                result = self.market.clear(spec)
            except NoMatch:
                continue
            plan = [(j, sessions[a.provider_id], a.price_micro_per_unit)
                    for a, j in zip(result.awards, jobs) if a.provider_id in sessions]
            if plan:
                return plan
        if not self.market.measured_any(first.plugin, spec.weights_digest):
            # Cold market: nobody (with the pinned weights) measured yet. The spine's rule
            # at the reserve, among providers with those weights at or above the
            # reputation floor (see MarketService.admitted); these jobs' receipts give the
            # broker its first θ.
            admitted = self.market.admitted(spec)
            plan = []
            for j in jobs:
                # (every session held joined the market: it heard of it from the presence)
                session = self._choose(j, allow=lambda s: s.provider_id in admitted)
                if session is not None:
                    plan.append((j, session, None))
            return plan
        return []

    # ---- loop ------------------------------------------------------------------------
    def kick(self) -> None:
        with self._cond:
            self._kicked = True
            self._cond.notify_all()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dispatcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        last_reap = 0.0
        while True:
            with self._cond:
                if not self._kicked and not self._stop:
                    self._cond.wait(self.reap_interval_s)
                if self._stop:
                    return
                self._kicked = False
            try:
                now = time.monotonic()
                if now - last_reap >= self.reap_interval_s:
                    last_reap = now
                    self.jobs.reap_expired()
                self.match_once()
            except Exception:  # noqa: BLE001 - the loop must survive a bad row or a DB blip
                log.exception("dispatcher iteration failed; retrying")
                time.sleep(0.2)

    def _tend(self) -> None:
        """Let the market re-read the sessions that changed, those holding jobs and a
        slice of the rest (all of them while there are few), and send the canaries due."""
        now = time.monotonic()
        with self._cond:
            sessions = self.presence.view()
            if len(sessions) <= TEND_ALL_UP_TO:
                batch = list(sessions.values())
            else:
                self._owed = min(self._owed + len(sessions) * (now - self._tended_at)
                                 / TEND_PERIOD_S, float(len(sessions)))
                batch = self._slice(int(self._owed))
                self._owed -= int(self._owed)
                batch += [sessions[p] for p in self._due if p in sessions]
                if now - self._busy_tended_at >= self.reap_interval_s:
                    # Their queue estimates follow the clock (re-posted when they drift by
                    # a second): every reap interval is often enough, not every pass.
                    self._busy_tended_at = now
                    batch += [sessions[p] for p in self._busy if p in sessions]
            self._tended_at = now
            self._due.clear()
        seen = set()
        for s in batch:
            if s.provider_id in seen:
                continue
            seen.add(s.provider_id)
            self._sync(s)
            if self.canary_sender is not None and s.free > 0:
                self.canary_sender(s)
            with self._cond:
                if s.active:
                    self._busy.add(s.provider_id)
                else:
                    self._busy.discard(s.provider_id)

    def _slice(self, k: int) -> list[AgentSession]:
        """The next ``k`` sessions of the ring (the caller holds the lock)."""
        sessions = self.presence.view()
        if len(self._ring) > 2 * len(sessions) + 64:  # drop those that left
            self._ring = list(dict.fromkeys(p for p in self._ring if p in sessions))
            self._ring_at = 0
        out, ring = [], self._ring
        for _ in range(min(k, len(ring))):
            self._ring_at %= len(ring)
            s = sessions.get(ring[self._ring_at])
            self._ring_at += 1
            if s is not None:
                out.append(s)
        return out

    def match_once(self) -> int:
        """Assign as many queued jobs as there are free slots; returns how many. What the
        pass sends an agent (jobs, canaries) goes out together as it ends, in one message
        where the agent takes batches (issue #28)."""
        with assignments_gathered():
            return self._match()

    def _match(self) -> int:
        if self.market is not None:
            self._tend()
        if not self.presence.any_free():
            self._backlog = True
            return 0
        self._backlog = True
        assigned = 0
        while True:
            batch = self._queue_snapshot(256)
            if not batch:
                self._backlog = False
                return assigned
            progress = False
            left = 0
            cleared: set[str] = set()  # placed, or siblings of a split cleared in this pass
            for job in batch:
                if job.id in cleared:
                    continue
                placed = self._place(job, batch)
                if not placed:
                    left += 1
                    continue
                self._forget(placed)
                cleared.update(placed)
                if job.batch_id:  # siblings left over wait for the next pass
                    siblings = {j.id for j in batch if j.batch_id == job.batch_id}
                    left += len(siblings - cleared)
                    cleared |= siblings
                assigned += len(placed)
                progress = True
                if not self.presence.any_free():
                    return assigned
            if not progress or len(batch) < 256:
                self._backlog = left > 0
                return assigned

    def _choose(self, job: Job, allow=None) -> AgentSession | None:
        able = [s for s in self.presence.serving_sessions(job).values()
                if s.free > 0 and s.serves(job)]
        able = [s for s in able if self.eligible(s.provider_id, job.plugin)
                and not _checked_operator(job, s)]
        if allow is not None:
            able = [s for s in able if allow(s)]
        if not able:
            return None
        fresh = [s for s in able if s.provider_id not in job.excluded_providers]
        # A check job must run on another operator: its exclusions are hard.
        pool = fresh if job.check_of else (fresh or able)
        if not pool:
            return None
        warm = [s for s in pool if not self.needs_download(s.provider_id, job)]
        pool = warm or pool  # those holding what the job names, if any
        best = min(len(s.active) / s.slots for s in pool)
        return self.rng.choice([s for s in pool if len(s.active) / s.slots == best])


def _checked_operator(job: Job, session: AgentSession) -> bool:
    """A job never runs on a machine of an operator its exclusions name as
    ``operator:<account id>`` (a check: the operator it checks; a job whose input a
    provider refused: that provider's operator), even one that connected after it was
    queued. Exclusions by provider id are soft (see _clear)."""
    return f"operator:{session.account_id}" in job.excluded_providers
