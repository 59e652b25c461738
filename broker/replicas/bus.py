"""ReplicaBus: how broker replicas wake each other.

A message on the bus is a wake-up, never a fact: "job X changed (and ended)", "jobs were
queued", "tell provider P's agent to cancel job X". The rows stay the truth. A replica that
may have missed messages (its listening connection dropped) is told so through the
handlers registered with :meth:`ReplicaBus.on_gap` and catches up from the rows (waiters
re-read their jobs, the dispatcher re-reads the queue). A message never comes back to the
replica that published it: each replica acts on its own changes in-process first.

Handlers run on the bus's listening thread, one message at a time: they must be quick
(wake a waiter, put a message in an agent's outbox, note an id for the dispatcher) and
must not wait on the database.
"""
from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from typing import Any, Protocol

Handler = Callable[[dict[str, Any]], None]


def new_replica_id() -> str:
    """A name for this broker process, unique across restarts: host, pid and a random tail
    (shown in logs and stored beside the agent streams it holds)."""
    return f"{socket.gethostname()[:40]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class ReplicaBus(Protocol):
    """The port the hub, the dispatcher and the admin use to reach other replicas."""

    replica_id: str

    @property
    def shared(self) -> bool:
        """Whether other replicas may exist (False: a one-process broker, SQLite)."""
        ...

    def publish(self, kind: str, data: dict[str, Any], urgent: bool = True) -> None:
        """Send ``data`` (JSON-able, small) to every other replica's ``kind`` handlers;
        best effort (see the module docstring). ``urgent``: someone waits on it (a job
        queued, a job's end, a command): it leaves at once, from the caller's thread; else
        (a job's progress) it goes with the next batch, off the caller's path.
        ``data["c"]``, when present, is a copy of rows the receivers can read instead (a
        queued job, an ended job): a bus may leave it out of a message too large to carry."""
        ...

    def subscribe(self, kind: str, handler: Handler) -> None:
        """Call ``handler(data)`` for each ``kind`` message another replica publishes."""
        ...

    def on_gap(self, handler: Callable[[], None]) -> None:
        """Call ``handler()`` whenever messages may have been missed (after the listening
        connection was re-established): catch up from the rows."""
        ...

    def start(self) -> None: ...

    def close(self) -> None: ...


class LocalBus:
    """One broker process (the embedded SQLite default): nobody else to wake."""

    shared = False

    def __init__(self, replica_id: str | None = None):
        self.replica_id = replica_id or new_replica_id()

    def publish(self, kind: str, data: dict[str, Any], urgent: bool = True) -> None:
        pass

    def subscribe(self, kind: str, handler: Handler) -> None:
        pass

    def on_gap(self, handler: Callable[[], None]) -> None:
        pass

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass
