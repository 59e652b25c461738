"""Answers that wait for a job (``?wait=``, ``Prefer: wait``, server-sent events) without
holding a thread while they wait.

A view hands its wait over as a *waiting generator* (see :mod:`broker.jobs.hub`): code that
yields a :class:`~broker.jobs.hub.HubWait` where it would block. Served by the broker's
asyncio front (:mod:`broker.web`), the front puts a :class:`Handover` in the WSGI environ;
the view leaves the generator there and returns at once, the front runs the generator's
steps in its thread pool and its waits on the event loop, and then has ``then`` build the
answer in a request context of its own (so the error handlers and after-request hooks
apply as to any answer). Under any other WSGI server, and Flask's test client, the same
view waits in its thread: one code path, two ways of waiting.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from flask import Response, request, stream_with_context

from broker.jobs.hub import HubWait, Waiting, drive
from .common import services

HANDOVER = "sparecycles.handover"  # the WSGI environ key the asyncio front sets


class Handover:
    """What the asyncio front and a view pass each other through the WSGI environ.
    ``may_wait``: the replica has room for one more waiting client (else a ``Prefer:
    wait`` is ignored, as RFC 7240 allows). The view sets ``steps`` and ``then`` (a long
    poll), or ``chunks`` (a stream whose response headers the view's answer gives)."""
    __slots__ = ("may_wait", "steps", "then", "wait", "chunks", "route")

    def __init__(self, may_wait: bool = True):
        self.may_wait = may_wait
        self.steps: Waiting | None = None
        self.then: Callable[[Any], Any] | None = None
        self.wait: HubWait | None = None  # the first wait ``steps`` yielded
        self.chunks: Iterator[str | HubWait] | None = None
        # The Flask rule that answered ("/v1/jobs/<job_id>"), for the metrics' route label
        # (the front's own answers and its refusals name theirs).
        self.route: str | None = None


def _handover() -> Handover | None:
    return request.environ.get(HANDOVER)


def may_wait() -> bool:
    """Whether this request may wait (False when the front has no room for another
    waiting client: the caller then answers at once)."""
    h = _handover()
    return h is None or h.may_wait


def answer_after(steps: Waiting, then: Callable[[Any], Any]):
    """The view's answer: ``then(result)`` once the waiting generator ``steps`` returns
    ``result``. An error ``steps`` raises is rendered like any error of the view."""
    h = _handover()
    if h is None:
        return then(drive(steps, services().jobs.hub))
    try:
        wait = next(steps)
    except StopIteration as stop:  # it needed no wait (the job had ended): answer now
        return then(stop.value)
    h.steps, h.then, h.wait = steps, then, wait
    return Response(status=204)  # the front answers with what ``then`` returns instead


def stream(chunks: Iterator[str | HubWait], **response) -> Response:
    """A streamed answer (``response``: Response keyword arguments, e.g. mimetype) whose
    body ``chunks`` yields, waiting where it yields a HubWait. The generator must not
    use the request context: under the front it runs after the view returned."""
    h = _handover()
    if h is None:
        hub = services().jobs.hub
        return Response(stream_with_context(_blocking(chunks, hub)), **response)
    h.chunks = chunks
    return Response(b"", **response)  # the front sends these headers, then the chunks


def _blocking(chunks: Iterator[str | HubWait], hub) -> Iterator[str]:
    for item in chunks:
        if isinstance(item, HubWait):
            hub.wait(item.job_id, item.version, item.timeout_s)
        else:
            yield item
