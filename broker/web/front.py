"""Front: the broker's ASGI app, served by uvicorn on the event loop.

* ``/livez``, ``/readyz`` and ``/metrics`` are answered here, on the loop: they never wait
  behind job traffic in the pool (``/readyz`` runs its database statement on a thread of
  its own, with a timeout).
* Everything else goes to the Flask app through the :class:`~.bridge.WsgiBridge`. Requests
  that wait for a job (``GET /v1/jobs/<id>?wait=``, ``GET /v1/batches/<id>?wait=``,
  ``GET /v1/jobs/<id>/events``, ``POST /v1/jobs`` with ``Prefer: wait``, the OpenAI-compatible
  ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/images/generations``) hand their wait
  over to the loop and hold no thread while they wait.
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
from dataclasses import dataclass
from urllib.parse import parse_qs

from broker.api import health
from broker.api.account import FUNDING_HEADER
from broker.api.waiting import Handover
from broker.app import problem_response
from broker.errors import BrokerError, NotReady, ReplicaFull
from .bridge import Pool, WsgiBridge, _Disconnected

log = logging.getLogger(__name__)

READYZ_DB_TIMEOUT_S = 2.0
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
    """``Front(app, services, pool, health_executor, limits, gateway_stats)``: the ASGI
    callable. ``gateway_stats``: the agent gateway's counters, shown at ``/metrics``."""

    def __init__(self, app, services, pool: Pool, health_executor, limits: FrontLimits,
                 gateway_stats=None):
        self.app = app
        self.services = services
        self.pool = pool
        self.bridge = WsgiBridge(app, pool, services.jobs.hub)
        self.health_executor = health_executor
        self.limits = limits
        self.gateway_stats = gateway_stats
        self.waiting = 0            # requests holding a waiting slot now
        self.refused = {"waiting": 0, "pool": 0}
        self._db_check: asyncio.Future | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # no websockets here: uvicorn closes the connection
        path, method = scope["path"], scope["method"]
        if method in ("GET", "HEAD"):
            if path == "/livez":
                await self._json(send, 200, {"status": "ok"}, method)
                return
            if path == "/readyz":
                await self._readyz(send, method)
                return
            if path == "/metrics":
                await self._metrics(send, method)
                return
        if self.bridge.starting >= self.limits.max_pool_requests:
            self.refused["pool"] += 1
            await self._refuse(send, ReplicaFull(
                f"this broker replica has {self.bridge.starting} requests in or waiting for "
                f"its thread pool (max_pool_requests {self.limits.max_pool_requests}); retry "
                f"after {RETRY_AFTER_S} s, or send it to another replica"))
            return
        handover = Handover()
        reserved = False
        if _waits(method, path, scope):
            if self.waiting < self.limits.max_waiting_clients:
                self.waiting += 1
                reserved = True
            elif method == "POST":
                handover.may_wait = False  # Prefer: wait is ignored; the job still goes in
            else:
                self.refused["waiting"] += 1
                await self._refuse(send, ReplicaFull(
                    f"this broker replica holds {self.waiting} waiting clients "
                    f"(max_waiting_clients {self.limits.max_waiting_clients}); retry after "
                    f"{RETRY_AFTER_S} s without waiting, or send it to another replica"))
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

    async def _problem(self, send, exc: BrokerError, extra: dict | None = None) -> None:
        resp = problem_response(self.app, exc.problem(), exc.http_status)
        for k, v in (extra or {}).items():
            resp.headers[k] = v
        resp.headers[FUNDING_HEADER] = self._funding_mode()
        await _send(send, resp.status_code,
                    [(k.lower().encode("latin1"), v.encode("latin1"))
                     for k, v in resp.headers.to_wsgi_list()], resp.get_data())

    async def _refuse(self, send, exc: ReplicaFull) -> None:
        await self._problem(send, exc, {"Retry-After": str(RETRY_AFTER_S)})

    async def _readyz(self, send, method: str) -> None:
        svc = self.services
        if self._db_check is None or self._db_check.done():
            # One statement at a time, shared by every /readyz meanwhile, on a thread that
            # job traffic never occupies.
            self._db_check = asyncio.get_running_loop().run_in_executor(
                self.health_executor, health.check_database, svc)
        try:
            await asyncio.wait_for(asyncio.shield(self._db_check), READYZ_DB_TIMEOUT_S)
        except asyncio.TimeoutError:
            await self._problem(send, NotReady(
                f"the database did not answer within {READYZ_DB_TIMEOUT_S:g} s"))
            return
        except BrokerError as exc:
            await self._problem(send, exc)
            return
        await self._json(send, 200, health.readiness(svc), method)

    async def _metrics(self, send, method: str) -> None:
        g = self.gateway_stats
        lines = [
            "# TYPE sparecycles_http_waiting_clients gauge",
            f"sparecycles_http_waiting_clients {self.waiting}",
            "# TYPE sparecycles_http_pool_load gauge",  # every step: requests, waits' re-reads
            f"sparecycles_http_pool_load {self.pool.load}",
            "# TYPE sparecycles_http_pool_requests gauge",  # what max_pool_requests limits
            f"sparecycles_http_pool_requests {self.bridge.starting}",
            "# TYPE sparecycles_http_refused_total counter",
            *(f'sparecycles_http_refused_total{{limit="{k}"}} {v}'
              for k, v in self.refused.items()),
        ]
        if g is not None:
            lines += [
                "# TYPE sparecycles_agent_streams gauge",
                f"sparecycles_agent_streams {g.streams}",
                "# TYPE sparecycles_agent_heartbeats_total counter",
                f"sparecycles_agent_heartbeats_total {g.heartbeats}",
                "# TYPE sparecycles_agent_messages_total counter",
                f"sparecycles_agent_messages_total {g.messages}",
                "# TYPE sparecycles_agent_streams_refused_total counter",
                f"sparecycles_agent_streams_refused_total {g.refused}",
                "# TYPE sparecycles_agent_streams_cut_off_total counter",
                f"sparecycles_agent_streams_cut_off_total {g.cut_off}",
            ]
        data = ("\n".join(lines) + "\n").encode()
        await _send(send, 200, [(b"content-type", b"text/plain; version=0.0.4"),
                                (b"content-length", str(len(data)).encode())],
                    b"" if method == "HEAD" else data)


def _waits(method: str, path: str, scope) -> bool:
    """Whether the request is one that waits for a job (see the module docstring)."""
    if method == "GET":
        if _EVENTS.match(path):
            return True
        return bool(_JOB.match(path)) and "wait" in parse_qs(
            scope["query_string"].decode("latin1"), keep_blank_values=True)
    if method == "POST" and path in _OPENAI_WAITS:
        return True  # over the limit, may_wait is False: the view refuses with a 503
    if method == "POST" and path == "/v1/jobs":
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
