"""WsgiBridge: runs a WSGI app (the Flask app) for an ASGI server, in a bounded thread pool.

What differs from a plain WSGI-in-a-thread adapter is that no thread is held while the
request waits for something outside the broker's CPU:

* a request body that arrives whole within ``BODY_PREFETCH_BYTES`` is read on the event
  loop first (a larger one, a package upload, is read by the pool thread as it arrives);
* the response body is pulled in the pool ``RESPONSE_CHUNK_BYTES`` at a time and sent on
  the loop, so a slow reader waits on the loop (the ASGI server's flow control), not in a
  thread, and never costs more than a chunk of memory;
* a view that waits for a job hands its waiting generator over through the environ
  (:mod:`broker.api.waiting`): its steps run in the pool, its waits on the loop.
"""
from __future__ import annotations

import asyncio
import io
import logging
import sys
from collections.abc import Callable
from typing import Any

from broker.api.waiting import HANDOVER, Handover
from broker.jobs.hub import EventHub, HubWait

log = logging.getLogger(__name__)

BODY_PREFETCH_BYTES = 1 << 20   # bodies up to this are read on the loop before the pool
BODY_IDLE_TIMEOUT_S = 60.0      # a body that sends nothing for this long has ended
RESPONSE_CHUNK_BYTES = 256 << 10  # response bytes pulled per pool step


class _Disconnected(Exception):
    """The client went away while its request waited."""


class _StreamingInput(io.RawIOBase):
    """``wsgi.input`` for a large body: the pool thread reads it from the loop as it
    arrives (``first`` is what was read already)."""

    def __init__(self, first: bytes, receive, loop: asyncio.AbstractEventLoop):
        self._buf = first
        self._receive = receive
        self._loop = loop
        self._more = True

    def readable(self) -> bool:
        return True

    def _fill(self) -> bool:
        if not self._more:
            return False
        pending = asyncio.run_coroutine_threadsafe(self._receive(), self._loop)
        try:
            msg = pending.result(BODY_IDLE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - silent client, or the broker stopping: it ends
            pending.cancel()
            msg = {"type": "http.disconnect"}
        if msg["type"] != "http.request":  # the client went away: the body ends short
            self._more = False
            return False
        self._buf += msg.get("body", b"")
        self._more = msg.get("more_body", False)
        return True

    def readinto(self, b) -> int:
        while not self._buf and self._fill():
            pass
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


class Pool:
    """The thread pool the front runs WSGI work in, counting the steps submitted and not
    finished (``load``): what the front's admission limit compares with."""

    def __init__(self, executor, loop: asyncio.AbstractEventLoop):
        self.executor = executor
        self.loop = loop
        self.load = 0

    async def run(self, fn: Callable, *args) -> Any:
        self.load += 1
        try:
            return await self.loop.run_in_executor(self.executor, fn, *args)
        finally:
            self.load -= 1


def build_environ(scope: dict, body) -> dict:
    """The WSGI environ (PEP 3333) of an ASGI HTTP scope."""
    script_name = scope.get("root_path", "").encode("utf8").decode("latin1")
    path_info = scope["path"].encode("utf8").decode("latin1")
    if script_name and path_info.startswith(script_name):
        path_info = path_info[len(script_name):]
    server = scope.get("server") or ("localhost", 80)
    environ = {
        "REQUEST_METHOD": scope["method"], "SCRIPT_NAME": script_name,
        "PATH_INFO": path_info, "QUERY_STRING": scope["query_string"].decode("latin1"),
        "SERVER_NAME": str(server[0]), "SERVER_PORT": str(server[1] or 0),
        "SERVER_PROTOCOL": f"HTTP/{scope['http_version']}",
        "wsgi.version": (1, 0), "wsgi.url_scheme": scope.get("scheme", "http"),
        "wsgi.input": body, "wsgi.errors": sys.stderr, "wsgi.multithread": True,
        "wsgi.multiprocess": False, "wsgi.run_once": False,
    }
    client = scope.get("client")
    if client:
        environ["REMOTE_ADDR"], environ["REMOTE_PORT"] = client[0], str(client[1])
    for raw_name, raw_value in scope["headers"]:
        name = raw_name.decode("latin1")
        if "_" in name:
            continue  # as waitress: X_Foo must not pass for X-Foo (HTTP_X_FOO)
        if name == "content-length":
            key = "CONTENT_LENGTH"
        elif name == "content-type":
            key = "CONTENT_TYPE"
        else:
            key = "HTTP_" + name.upper().replace("-", "_")
        value = raw_value.decode("latin1")
        if key in environ:
            value = environ[key] + ("; " if key == "HTTP_COOKIE" else ",") + value
        environ[key] = value
    if "CONTENT_LENGTH" not in environ:
        # A chunked body has no length: the input ends where the body does. (With a
        # length, a body that ends short is the client's disconnect, as werkzeug says.)
        environ["wsgi.input_terminated"] = True
    return environ


class _Reply:
    """What a pool step hands back to the loop: the response so far and what comes next
    (``iterator`` with more body to pull, ``wait`` to await, ``chunks`` to stream)."""
    __slots__ = ("status", "headers", "body", "iterable", "iterator", "wait", "steps",
                 "then", "chunks", "done")

    def __init__(self):
        self.status = 500
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.iterable = self.iterator = None
        self.wait: HubWait | None = None
        self.steps = self.then = self.chunks = None
        self.done = True


class WsgiBridge:
    """``await bridge(scope, receive, send, handover)`` answers one HTTP request with the
    WSGI ``app`` (its ``request_context``, ``handle_user_exception`` and
    ``finalize_request`` build the answer after a wait: a Flask app)."""

    def __init__(self, app, pool: Pool, hub: EventHub):
        self.app = app
        self.pool = pool
        self.hub = hub
        self.starting = 0  # requests in or waiting for their first pool step (the app)

    async def __call__(self, scope: dict, receive, send, handover: Handover,
                       on_wait: Callable[[bool], None] = lambda waiting: None) -> None:
        loop = self.pool.loop
        body, more = await _prefetch(receive)
        wsgi_input = (_StreamingInput(body, receive, loop) if more
                      else io.BytesIO(body))
        environ = build_environ(scope, wsgi_input)
        environ[HANDOVER] = handover
        self.starting += 1
        try:
            reply = await self.pool.run(self._start, environ)
        finally:
            self.starting -= 1
        if reply.wait is None and reply.chunks is None:
            await self._send_response(send, reply)
            return
        on_wait(True)
        watcher = asyncio.ensure_future(_disconnect(receive)) if not more else None
        try:
            if reply.chunks is not None:
                await self._stream(send, reply, watcher)
                return
            while reply.wait is not None:
                version = await _watched(self.hub.wait_async(
                    reply.wait.job_id, reply.wait.version, reply.wait.timeout_s), watcher)
                reply = await self.pool.run(self._step, environ, reply, version)
            await self._send_response(send, reply)
        except _Disconnected:
            if reply.steps is not None:
                reply.steps.close()
            if reply.chunks is not None:
                reply.chunks.close()
        finally:
            on_wait(False)
            if watcher is not None:
                watcher.cancel()

    # ---- pool steps ----------------------------------------------------------------
    def _start(self, environ: dict) -> _Reply:
        """Run the app; pull the first part of its answer, or the first step of the wait
        it handed over."""
        reply = _Reply()
        started: list = []

        def start_response(status: str, headers, exc_info=None):
            started[:] = [status, headers]
            return _no_write

        iterable = self.app(environ, start_response)
        reply.status = int(started[0].split(" ", 1)[0])
        reply.headers = [(k.lower().encode("latin1"), v.encode("latin1"))
                         for k, v in started[1]]
        h: Handover = environ[HANDOVER]
        if h.steps is not None or h.chunks is not None:
            _close(iterable)  # the placeholder: the answer comes after the wait
            if h.chunks is not None:
                reply.headers = [(k, v) for k, v in reply.headers if k != b"content-length"]
                reply.chunks = h.chunks
                return self._pull_chunks(reply)
            reply.steps, reply.then, reply.wait = h.steps, h.then, h.wait
            return reply
        reply.iterable = iterable
        self._pull(reply)
        return reply

    def _step(self, environ: dict, reply: _Reply, version: int) -> _Reply:
        if reply.chunks is not None:
            return self._pull_chunks(reply)
        return self._advance(environ, reply, version)

    def _advance(self, environ: dict, reply: _Reply, version: int) -> _Reply:
        """One step of a handed-over wait; at its end, the view's answer."""
        try:
            reply.wait = reply.steps.send(version)
            return reply
        except StopIteration as stop:
            outcome, error = stop.value, None
        except Exception as exc:  # noqa: BLE001 - rendered by the app's error handlers
            outcome, error = None, exc
        reply.wait = None
        return self._finish(environ, reply, outcome, error)

    def _finish(self, environ: dict, reply: _Reply, outcome, error) -> _Reply:
        """The view's ``then(outcome)`` (or the error the wait raised) as the app would
        answer it: in a request context, through its error handlers and after-request
        hooks."""
        app = self.app
        started: list = []

        def start_response(status: str, headers, exc_info=None):
            started[:] = [status, headers]
            return _no_write

        with app.request_context(environ):
            try:
                if error is not None:
                    raise error
                rv = reply.then(outcome)
            except Exception as exc:  # noqa: BLE001 - the app's handlers decide
                rv = app.handle_user_exception(exc)
            response = app.finalize_request(rv)
            reply.iterable = response(environ, start_response)
        reply.status = int(started[0].split(" ", 1)[0])
        reply.headers = [(k.lower().encode("latin1"), v.encode("latin1"))
                         for k, v in started[1]]
        self._pull(reply)
        return reply

    @staticmethod
    def _pull(reply: _Reply) -> _Reply:
        """Up to RESPONSE_CHUNK_BYTES of the body of ``reply.iterable``; ``done`` is False
        when more is to come."""
        it = reply.iterator or iter(reply.iterable)
        parts, size = [], 0
        try:
            for part in it:
                if part:
                    parts.append(part)
                    size += len(part)
                    if size >= RESPONSE_CHUNK_BYTES:
                        reply.iterator, reply.done = it, False
                        reply.body = b"".join(parts)
                        return reply
        except BaseException:
            _close(reply.iterable)
            raise
        _close(reply.iterable)
        reply.iterable = reply.iterator = None
        reply.done = True
        reply.body = b"".join(parts)
        return reply

    @staticmethod
    def _pull_chunks(reply: _Reply) -> _Reply:
        """An event stream's text up to its next wait (or its end)."""
        parts = []
        reply.wait = None
        try:
            for item in reply.chunks:
                if isinstance(item, HubWait):
                    reply.wait = item
                    break
                parts.append(item.encode() if isinstance(item, str) else item)
        except Exception:  # noqa: BLE001 - a broken stream ends; the client reconnects
            log.exception("an event stream failed; closing it")
        reply.body = b"".join(parts)
        reply.done = reply.wait is None
        return reply

    # ---- the loop's side -------------------------------------------------------------
    async def _send_response(self, send, reply: _Reply) -> None:
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": reply.headers})
        await send({"type": "http.response.body", "body": reply.body,
                    "more_body": not reply.done})
        if reply.done:
            return
        try:
            while not reply.done:
                reply = await self.pool.run(self._pull, reply)
                await send({"type": "http.response.body", "body": reply.body,
                            "more_body": not reply.done})
        finally:
            if reply.iterable is not None:  # the client went away mid-body
                await self.pool.run(_close, reply.iterable)

    async def _stream(self, send, reply: _Reply, watcher) -> None:
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": reply.headers})
        while True:
            await send({"type": "http.response.body", "body": reply.body,
                        "more_body": not reply.done})
            if reply.done:
                return
            await _watched(self.hub.wait_async(reply.wait.job_id, reply.wait.version,
                                               reply.wait.timeout_s), watcher)
            reply = await self.pool.run(self._pull_chunks, reply)


def _no_write(data: bytes) -> None:
    raise RuntimeError("the broker's WSGI bridge does not support write(); return an "
                       "iterable from the app")


def _close(iterable) -> None:
    close = getattr(iterable, "close", None)
    if close is not None:
        close()


async def _prefetch(receive) -> tuple[bytes, bool]:
    """The request body, read on the loop up to BODY_PREFETCH_BYTES; (bytes, more)."""
    parts, size, more = [], 0, True
    while more and size < BODY_PREFETCH_BYTES:
        msg = await receive()
        if msg["type"] != "http.request":
            raise _Disconnected()
        part = msg.get("body", b"")
        if part:
            parts.append(part)
            size += len(part)
        more = msg.get("more_body", False)
    return b"".join(parts), more


async def _disconnect(receive) -> None:
    """Returns when the client disconnects (the body is read by then)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _watched(aw, watcher):
    """``await aw``, unless the client disconnects first (then _Disconnected)."""
    if watcher is None:
        return await aw
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        return task.result()
    task.cancel()
    raise _Disconnected()
