"""Front: the broker's ASGI app, served by uvicorn on the event loop.

* ``/livez``, ``/readyz`` and ``/metrics`` are answered here, on the loop: they never wait
  behind job traffic in the pool (``/readyz`` runs its database statement on a thread of
  its own, with a timeout).
* Everything else goes to the Flask app through the :class:`~.bridge.WsgiBridge`. Requests
  that wait for a job (``GET /v1/jobs/<id>?wait=``, ``GET /v1/batches/<id>?wait=``,
  ``GET /v1/jobs/<id>/events``, ``POST /v1/jobs`` and ``POST /v1/jobs/bulk`` with ``Prefer:
  wait``, the OpenAI-compatible ``POST /v1/chat/completions``, ``/v1/completions``,
  ``/v1/images/generations``) hand their wait over to the loop and hold no thread while
  they wait.
* Limits: at most ``max_waiting_clients`` such requests at once and ``max_pool_requests``
  requests running in or queued for the pool (their first step: the app's view; the
  re-reads of waiting requests, bounded by the first limit, do not count); past them the
  answer is a 503
  ``replica_full`` with ``Retry-After`` (a ``Prefer: wait`` is ignored instead, as RFC 7240
  allows: the job is submitted and answered at once).
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from urllib.parse import parse_qs

from broker.api import health
from broker.api.account import FUNDING_HEADER
from broker.api.waiting import Handover
from broker.api.common import REQUEST_ID, new_request_id, sane_request_id
from broker.app import problem_response
from broker.errors import BrokerError, NotReady, ReplicaFull
from broker.observability.metrics import CONTENT_TYPE, BrokerMetrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from .bridge import Pool, WsgiBridge, _Disconnected

log = logging.getLogger(__name__)

READYZ_DB_TIMEOUT_S = 2.0
METRICS_TIMEOUT_S = 10.0  # a scrape waits at most this for the database's facts
RETRY_AFTER_S = 1
_JOB = re.compile(r"^/v1/(jobs|batches)/[^/]+$")
_EVENTS = re.compile(r"^/v1/jobs/[^/]+/events$")
_PREFER_WAIT = re.compile(rb"(^|,)\s*wait\s*=", re.IGNORECASE)
# The OpenAI-compatible routes (broker/api/openai_compat.py) wait for their job.
_OPENAI_WAITS = frozenset({"/v1/chat/completions", "/v1/completions",
                           "/v1/images/generations"})


@dataclass
class FrontLimits:
    max_waiting_clients: int = 10_000
    max_pool_requests: int = 1024


class Front:
    """``Front(app, services, pool, health_executor, limits, metrics)``: the ASGI
    callable. ``metrics``: the broker's metrics, served at ``/metrics``, the front's own
    gauges among them; ``count_requests``: every answer counted by route and status with
    its latency (off for bench/dispatch.py --metrics off)."""

    def __init__(self, app, services, pool: Pool, health_executor, limits: FrontLimits,
                 metrics: BrokerMetrics, count_requests: bool = True):
        self.app = app
        self.services = services
        self.pool = pool
        self.bridge = WsgiBridge(app, pool, services.jobs.hub)
        self.health_executor = health_executor
        self.limits = limits
        self.metrics = metrics
        self.count_requests = count_requests
        metrics.add_collector(self.collect)
        self.waiting = 0            # requests holding a waiting slot now
        self.refused = {"waiting": 0, "pool": 0}
        self._db_check: asyncio.Future | None = None
        self.draining = False  # set as the broker starts to stop: /readyz says so

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # no websockets here: uvicorn closes the connection
        path, method = scope["path"], scope["method"]
        if not self.count_requests:
            await self._answer(scope, receive, send, path, method)
            return
        started = time.perf_counter()
        handover = Handover()
        status = 499  # (nginx's "client closed request": no answer was started)

        async def counted_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self._answer(scope, receive, counted_send, path, method, handover)
        finally:
            self.metrics.http_request(handover.route or "(unmatched)", method, status,
                                      time.perf_counter() - started)

    async def _answer(self, scope, receive, send, path: str, method: str,
                      handover: Handover | None = None) -> None:
        """Answer one request (``handover.route`` is set to the route that answered it:
        the Flask rule, the path of what the front answers itself, "(refused)")."""
        handover = handover or Handover()
        if method in ("GET", "HEAD") and path in _OWN:
            handover.route = path
            await _OWN[path](self, send, method, scope)
            return
        if self.bridge.starting >= self.limits.max_pool_requests:
            self.refused["pool"] += 1
            handover.route = "(refused)"
            await self._refuse(send, ReplicaFull(
                f"this broker replica has {self.bridge.starting} requests in or waiting for "
                f"its thread pool (max_pool_requests {self.limits.max_pool_requests}); retry "
                f"after {RETRY_AFTER_S} s, or send it to another replica"), scope)
            return
        reserved = False
        if _waits(method, path, scope):
            if self.waiting < self.limits.max_waiting_clients:
                self.waiting += 1
                reserved = True
            elif method == "POST":
                handover.may_wait = False  # Prefer: wait is ignored; the job still goes in
            else:
                self.refused["waiting"] += 1
                handover.route = "(refused)"
                await self._refuse(send, ReplicaFull(
                    f"this broker replica holds {self.waiting} waiting clients "
                    f"(max_waiting_clients {self.limits.max_waiting_clients}); retry after "
                    f"{RETRY_AFTER_S} s without waiting, or send it to another replica"),
                    scope)
                return

        def on_wait(waiting: bool) -> None:  # a wait no route rule foresaw counts too
            if not reserved:
                self.waiting += 1 if waiting else -1
        try:
            await self.bridge(scope, receive, send, handover, on_wait)
        except _Disconnected:
            pass
        finally:
            if reserved:
                self.waiting -= 1

    # ---- answered on the loop --------------------------------------------------------
    def _funding_mode(self) -> str:
        return self.services.payments.funding_mode

    async def _json(self, send, status: int, body: dict, method: str = "GET") -> None:
        data = (self.app.json.dumps(body, separators=(",", ":")) + "\n").encode()
        await _send(send, status, [(b"content-type", b"application/json"),
                                   (b"content-length", str(len(data)).encode()),
                                   (FUNDING_HEADER.lower().encode(),
                                    self._funding_mode().encode())],
                    b"" if method == "HEAD" else data)

    async def _problem(self, send, exc: BrokerError, extra: dict | None = None,
                       scope=None) -> None:
        rid = _request_id(scope)
        resp = problem_response(self.app, {**exc.problem(), "request_id": rid},
                                exc.http_status)
        resp.headers[REQUEST_ID] = rid
        for k, v in (extra or {}).items():
            resp.headers[k] = v
        resp.headers[FUNDING_HEADER] = self._funding_mode()
        await _send(send, resp.status_code,
                    [(k.lower().encode("latin1"), v.encode("latin1"))
                     for k, v in resp.headers.to_wsgi_list()], resp.get_data())

    async def _refuse(self, send, exc: ReplicaFull, scope=None) -> None:
        await self._problem(send, exc, {"Retry-After": str(RETRY_AFTER_S)}, scope)

    async def _readyz(self, send, method: str, scope=None) -> None:
        svc = self.services
        if self._db_check is None or self._db_check.done():
            # One statement at a time, shared by every /readyz meanwhile, on a thread that
            # job traffic never occupies.
            self._db_check = asyncio.get_running_loop().run_in_executor(
                self.health_executor, lambda: health.check_ready(svc, draining=self.draining))
        try:
            await asyncio.wait_for(asyncio.shield(self._db_check), READYZ_DB_TIMEOUT_S)
        except asyncio.TimeoutError:
            detail = f"the database did not answer within {READYZ_DB_TIMEOUT_S:g} s"
            await self._problem(send, NotReady(detail, reasons=[
                {"check": "database", "detail": detail}]), scope=scope)
            return
        except BrokerError as exc:
            await self._problem(send, exc, scope=scope)
            return
        await self._json(send, 200, health.readiness(svc), method)

    async def _livez(self, send, method: str, scope=None) -> None:
        await self._json(send, 200, {"status": "ok"}, method)

    async def _metrics(self, send, method: str, scope=None) -> None:
        # Off the loop: the database's shared facts may need a read (cached a while).
        try:
            data = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                self.health_executor, self.metrics.render), METRICS_TIMEOUT_S)
        except asyncio.TimeoutError:
            await self._problem(send, NotReady(
                f"/metrics took longer than {METRICS_TIMEOUT_S:g} s (the database's "
                "facts did not come); see sparecycles_metrics_database_up"), scope=scope)
            return
        await _send(send, 200, [(b"content-type", CONTENT_TYPE.encode()),
                                (b"content-length", str(len(data)).encode())],
                    b"" if method == "HEAD" else data)

    def collect(self):
        """The front's own gauges and counters, at scrape time."""
        yield _gauge("sparecycles_http_waiting_clients",
                     "Requests waiting for a job now (long polls, Prefer: wait, event "
                     "streams).", self.waiting)
        yield _gauge("sparecycles_http_pool_load", "Steps in or queued for the HTTP "
                     "thread pool (requests and waiting requests' re-reads).", self.pool.load)
        yield _gauge("sparecycles_http_pool_requests", "Requests in or waiting for their "
                     "first pool step (what max_pool_requests limits).", self.bridge.starting)
        refused = CounterMetricFamily("sparecycles_http_refused", "Requests refused with "
                                      "503 replica_full, by the limit reached.",
                                      labels=["limit"])
        for k, v in self.refused.items():
            refused.add_metric([k], v)
        yield refused


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


def _request_id(scope) -> str:
    """The client's X-Request-Id when it sent a sane one, else a new one (as the Flask
    app's, broker.api.common.request_id)."""
    for name, value in (scope or {}).get("headers", ()):
        if name == b"x-request-id":
            sent = sane_request_id(value.decode("latin1"))
            if sent:
                return sent
    return new_request_id()


_OWN = {"/livez": Front._livez, "/readyz": Front._readyz, "/metrics": Front._metrics}


def _waits(method: str, path: str, scope) -> bool:
    """Whether the request is one that waits for a job (see the module docstring)."""
    if method == "GET":
        if _EVENTS.match(path):
            return True
        return bool(_JOB.match(path)) and "wait" in parse_qs(
            scope["query_string"].decode("latin1"), keep_blank_values=True)
    if method == "POST" and path in _OPENAI_WAITS:
        return True  # over the limit, may_wait is False: the view refuses with a 503
    if method == "POST" and path in ("/v1/jobs", "/v1/jobs/bulk"):
        return any(name == b"prefer" and _PREFER_WAIT.search(value)
                   for name, value in scope["headers"])
    return False


async def _send(send, status: int, headers: list, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _lifespan(receive, send) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
