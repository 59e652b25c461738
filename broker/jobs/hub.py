"""EventHub: wakes whoever waits on a job (long-poll GETs, server-sent event streams).

The events themselves live in the database; the hub only says "something happened to job
X" (and whether that was its end), so a waiter re-reads when it needs to. The end may come
with the job as it was written (a settlement's row and outputs): while nothing else has
happened to the job since, a waiter takes that copy instead of reading it back. Each job
has its own waiters: a notification wakes only those watching that job (one shared
condition would wake every long-poll on every event and have each of them re-query the
database).

A waiter is either a thread (:meth:`EventHub.wait` blocks it) or an asyncio task
(:meth:`EventHub.wait_async`: a future on its event loop, woken with
``call_soon_threadsafe`` from whatever thread settles the job), so a waiting HTTP client
served on the event loop costs a future, not a thread.

Code that waits is written once as a generator that yields a :class:`HubWait` where it
would block and is sent the job's version after it (``JobService.waiting``, the events
stream): :func:`drive` runs such a generator in a thread, the asyncio front
(``broker.web``) runs its steps in a thread pool and its waits on the loop.
"""
from __future__ import annotations

import asyncio
import json
import random
import threading
from collections import OrderedDict
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from broker.replicas.bus import ReplicaBus


class CopyCodec(Protocol):
    """An end's copy as JSON for other replicas (broker.jobs.model.SettledCopyCodec)."""

    def encode(self, copy: Any) -> dict: ...
    def decode(self, doc: dict) -> Any: ...

T = TypeVar("T")


@dataclass(frozen=True)
class HubWait:
    """What a waiting generator yields: wait until ``job_id``'s version differs from
    ``version`` or ``timeout_s`` passes; the generator is then sent the version."""
    job_id: str
    version: int
    timeout_s: float


Waiting = Generator[HubWait, int, T]

QUIET_SLICE_S = 5.0


def quiet_slice_s() -> float:
    """How long a waiter waits before it re-reads without a notification (the job may
    have changed on another replica): 4 to 6 s at random, so that clients that started
    waiting together do not all re-read together."""
    return QUIET_SLICE_S * (0.8 + 0.4 * random.random())


class _LoopWaiter:
    """An asyncio future waiting in the hub, with the loop that owns it."""
    __slots__ = ("loop", "future")

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future):
        self.loop, self.future = loop, future

    def set(self) -> None:
        try:
            self.loop.call_soon_threadsafe(_resolve, self.future)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class EventHub:
    MAX_TRACKED = 100_000
    MAX_COPIES = 4096  # ended jobs' copies kept (the newest), for waiters about to read

    MAX_WIRE_COPY = 6_000  # characters of JSON: a larger copy is not sent (waiters read)

    def __init__(self, bus: "ReplicaBus | None" = None, codec: "CopyCodec | None" = None):
        """``bus``: where the changes of jobs travel to other broker replicas (and come
        from them), so that a client waiting on one replica hears at once of a job that
        ends on another. None (or a LocalBus): this process only. ``codec``: turns an
        end's copy into JSON and back, so that it travels with the wake-up when small."""
        self._lock = threading.Lock()
        self.bus = bus
        self.codec = codec
        self._versions: dict[str, int] = {}
        self._waiters: dict[str, list[threading.Event | _LoopWaiter]] = {}
        self._ended: set[str] = set()
        self._copies: OrderedDict[str, tuple[int, Any]] = OrderedDict()
        if bus is not None:
            bus.subscribe("job", self._from_replica)
            bus.on_gap(self.wake_all)

    def version(self, job_id: str) -> int:
        with self._lock:
            return self._versions.get(job_id, 0)

    def ended(self, job_id: str) -> bool:
        """Whether this process saw the job end (settled, failed, cancelled). False also
        when it ended elsewhere (another broker replica) or was forgotten: a waiter that
        must know for sure reads the database."""
        with self._lock:
            return job_id in self._ended

    def copy(self, job_id: str) -> Any:
        """What the job's end was notified with, if nothing has happened to it since."""
        with self._lock:
            held = self._copies.get(job_id)
            return held[1] if held and held[0] == self._versions.get(job_id, 0) else None

    def waiting(self) -> int:
        """How many waiters (threads and futures) are registered now."""
        with self._lock:
            return sum(len(w) for w in self._waiters.values())

    def notify(self, job_id: str, ended: bool = False, copy: Any = None,
               relay: bool = True) -> None:
        """Something happened to ``job_id``; ``ended``: it reached a terminal state;
        ``copy``: the job as that end wrote it (see :meth:`copy`). Other replicas hear of
        it through the bus (with the copy when it is small), unless ``relay`` is False (a
        job just created: nobody elsewhere knows its id yet)."""
        self._notify(job_id, ended, copy)
        if relay and self.bus is not None and self.bus.shared:
            message: dict[str, Any] = {"j": job_id, "e": 1} if ended else {"j": job_id}
            if copy is not None and self.codec is not None:
                try:
                    wire = self.codec.encode(copy)
                    if len(json.dumps(wire, separators=(",", ":"))) <= self.MAX_WIRE_COPY:
                        message["c"] = wire
                except (TypeError, ValueError):  # not JSON-able: the waiters read the row
                    pass
            # A job's end wakes a waiting client: at once. Its steps before (assigned,
            # progress) matter to event streams only: batched, off the caller's path.
            self.bus.publish("job", message, urgent=ended)

    def _from_replica(self, data: dict) -> None:
        job_id = data.get("j")
        if not isinstance(job_id, str):
            return
        copy = None
        if data.get("c") is not None and self.codec is not None:
            try:
                copy = self.codec.decode(data["c"])
            except (KeyError, TypeError, ValueError):
                copy = None  # read back instead
        self._notify(job_id, bool(data.get("e")), copy)

    def wake_all(self) -> None:
        """Wake every waiter without changing any version: each re-reads its job (after
        wake-ups from other replicas may have been lost)."""
        with self._lock:
            waiters = [w for ws in self._waiters.values() for w in ws]
            self._waiters.clear()
        for w in waiters:
            w.set()

    def _notify(self, job_id: str, ended: bool, copy: Any) -> None:
        with self._lock:
            if len(self._versions) > self.MAX_TRACKED:
                # Forgetting versions only makes a waiter re-read once too often.
                self._versions.clear()
                self._ended.clear()
                self._copies.clear()
            version = self._versions[job_id] = self._versions.get(job_id, 0) + 1
            if ended:
                self._ended.add(job_id)
            if copy is not None:
                self._copies[job_id] = (version, copy)
                if len(self._copies) > self.MAX_COPIES:
                    self._copies.popitem(last=False)
            else:
                self._copies.pop(job_id, None)
            waiters = self._waiters.pop(job_id, ())
        for w in waiters:
            w.set()

    def wait(self, job_id: str, seen_version: int, timeout_s: float) -> int:
        """Block until the job's version differs from ``seen_version`` or the timeout passes;
        returns the current version."""
        ev = threading.Event()
        if not self._register(job_id, seen_version, ev):
            return self.version(job_id)
        ev.wait(timeout_s)
        return self._unregister(job_id, ev)

    async def wait_async(self, job_id: str, seen_version: int, timeout_s: float) -> int:
        """:meth:`wait` for a task on an event loop: it awaits a future, no thread."""
        loop = asyncio.get_running_loop()
        waiter = _LoopWaiter(loop, loop.create_future())
        if not self._register(job_id, seen_version, waiter):
            return self.version(job_id)
        timer = loop.call_later(max(0.0, timeout_s), _resolve, waiter.future)
        try:
            await waiter.future
        finally:
            timer.cancel()
            version = self._unregister(job_id, waiter)
        return version

    def _register(self, job_id: str, seen_version: int, waiter) -> bool:
        """Add ``waiter`` unless the version moved already (then False: no wait)."""
        with self._lock:
            if self._versions.get(job_id, 0) != seen_version:
                return False
            self._waiters.setdefault(job_id, []).append(waiter)
            return True

    def _unregister(self, job_id: str, waiter) -> int:
        with self._lock:
            waiting = self._waiters.get(job_id)
            if waiting and waiter in waiting:
                waiting.remove(waiter)
                if not waiting:
                    del self._waiters[job_id]
            return self._versions.get(job_id, 0)


def drive(steps: Waiting[T], hub: EventHub) -> T:
    """Run a waiting generator in this thread, blocking at each of its waits."""
    try:
        wait = next(steps)
        while True:
            wait = steps.send(hub.wait(wait.job_id, wait.version, wait.timeout_s))
    except StopIteration as stop:
        return stop.value
