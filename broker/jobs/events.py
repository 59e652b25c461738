"""What the job service tells the rest of the broker, and the relay that carries it.

:class:`JobEvents` is the one port the job service speaks through: a job queued, a slot
released, a running job cancelled, a second opinion asked on an input a provider refused,
a settled receipt, a settlement, an end without settlement. :class:`JobEventRelay` is its
implementation: built before the job service and passed to it at construction, it relays
each event to the listeners the wiring (``broker/services.py``) joined to it afterwards,
the dispatcher (:class:`Placement`), the market (:class:`ReceiptWatcher`) and verification
(:class:`EndWatcher`), which are all built after the job service. With nobody joined an
event does nothing and a second opinion is None (no other operator), which is what a job
service without a dispatcher, a market or verification does.

A listener's exception reaches the job service, which decides what a failure means there
(a receipt's measurement is logged and never undoes a settlement, a check's wake-up is
logged after the commit, and so on), as when each was a single hook.
"""
from __future__ import annotations

from typing import Protocol

from .model import Job


class JobEvents(Protocol):
    """What the job service tells the rest (``JobService(job_events=...)``)."""

    def queued(self, job: Job, siblings: list[Job] | None = None) -> None:
        """``job`` was queued (``siblings``: a split's jobs, all just queued)."""

    def released(self, provider_id: str | None, job_id: str) -> None:
        """``provider_id``'s slot for ``job_id`` is free."""

    def cancel(self, job: Job) -> None:
        """Tell the agent that holds ``job`` to stop it."""

    def second_opinion(self, job: Job, provider_id: str) -> str | None:
        """``provider_id``'s operator when a provider of another operator could run
        ``job`` now (its input was refused as bad), else None."""

    def receipt(self, job: Job, receipt: dict, received_at: float) -> None:
        """A receipt settled ``job``; it reached the broker at ``received_at`` (epoch s)."""

    def settled(self, job: Job, receipt: dict) -> None:
        """``job`` settled (its money moved), before its client is woken."""

    def ended(self, job: Job) -> None:
        """``job`` ended without settling (failed, cancelled, given up)."""


class Placement(Protocol):
    """Who places jobs on agents (broker.jobs.dispatch.Dispatcher): one per relay."""

    def queued(self, job: Job, siblings: list[Job] | None = None) -> None: ...

    def released(self, provider_id: str | None, job_id: str) -> None: ...

    def cancel(self, job: Job) -> None: ...

    def second_opinion(self, job: Job, provider_id: str) -> str | None: ...


class ReceiptWatcher(Protocol):
    """Who learns from settled receipts (the market: θ, canaries' inputs)."""

    def receipt(self, job: Job, receipt: dict, received_at: float) -> None: ...


class EndWatcher(Protocol):
    """Who hears how jobs end (verification: the draw, the judging, checks' ends)."""

    def settled(self, job: Job, receipt: dict) -> None: ...

    def ended(self, job: Job) -> None: ...


class JobEventRelay:
    """:class:`JobEvents` relayed to the listeners joined to it, in the order they joined.
    Joining happens while the broker is wired, before any job moves."""

    def __init__(self) -> None:
        self._placement: Placement | None = None
        self._receipts: list[ReceiptWatcher] = []
        self._ends: list[EndWatcher] = []

    # ---- joining (broker/services.py) --------------------------------------------------
    def join_placement(self, placement: Placement) -> None:
        """``placement`` places the jobs queued from now on. There is one: a second one is
        refused (two dispatchers would each hand out every job)."""
        if self._placement is not None and self._placement is not placement:
            raise ValueError(f"jobs are already placed by {self._placement!r}; one "
                             "dispatcher per job service")
        self._placement = placement

    def join_receipts(self, watcher: ReceiptWatcher) -> None:
        self._receipts.append(watcher)

    def join_ends(self, watcher: EndWatcher) -> None:
        self._ends.append(watcher)

    # ---- JobEvents ---------------------------------------------------------------------
    def queued(self, job: Job, siblings: list[Job] | None = None) -> None:
        if self._placement is not None:
            self._placement.queued(job, siblings=siblings)

    def released(self, provider_id: str | None, job_id: str) -> None:
        if self._placement is not None:
            self._placement.released(provider_id, job_id)

    def cancel(self, job: Job) -> None:
        if self._placement is not None:
            self._placement.cancel(job)

    def second_opinion(self, job: Job, provider_id: str) -> str | None:
        if self._placement is None:
            return None  # nobody to ask: no provider of another operator is known
        return self._placement.second_opinion(job, provider_id)

    def receipt(self, job: Job, receipt: dict, received_at: float) -> None:
        for watcher in self._receipts:
            watcher.receipt(job, receipt, received_at)

    def settled(self, job: Job, receipt: dict) -> None:
        for watcher in self._ends:
            watcher.settled(job, receipt)

    def ended(self, job: Job) -> None:
        for watcher in self._ends:
            watcher.ended(job)
