"""Runs the broker: HTTP and gRPC on one asyncio event loop, in one process sharing one set
of services (docs/architecture.md, *Runtime*).

The loop (uvloop, thread ``broker-io``) serves agents' streams on grpc's asyncio server
and HTTP on uvicorn (httptools), whose ASGI app (:class:`broker.web.front.Front`) answers
health and metrics itself, holds waiting clients as futures and runs the Flask app for the
rest in a bounded thread pool (``http_threads``). Agents' messages are handled in a pool of
their own (``agent_threads``). Nothing is a thread per connection.
"""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import resource
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import uvicorn
import uvloop
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sdk.protocol import agent_pb2_grpc as pb_grpc

from broker.app import create_app
from broker.gateway.servicer import AgentGatewayServicer, GatewayStats
from broker.observability.metrics import agent_families
from broker.services import Services, build_services
from broker.replicas.service import ReplicaMismatch
from broker.storage.sealed import AtRestError
from broker.settings import Settings
from broker.storage.lock import DatabaseInUse, hold_serve_lock
from broker.storage.migrate import NotMigrated
from broker.tls import TLSError, check_plaintext, check_server_cert
from broker.web.bridge import Pool
from broker.web.front import Front, FrontLimits

log = logging.getLogger("broker")

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]
HTTP_IDLE_TIMEOUT_S = 120  # an idle keep-alive connection is closed after this
SHUTDOWN_GRACE_S = 2.0
HEALTH_INTERVAL_S = 5.0  # how often the gRPC health service's status is re-checked
GATEWAY_SERVICE = "sparecycles.v1.AgentGateway"
# Young collections every 50,000 allocations, full ones rarely: see tune_gc.
GC_THRESHOLDS = (50_000, 20, 100)


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"address {addr!r} must look like HOST:PORT (e.g. 127.0.0.1:8080)")
    return host, int(port)


def raise_open_files_limit() -> int:
    """Raise this process's soft limit of open files to the hard limit (each agent stream
    and each waiting client is a socket; 1,024 is a common soft limit); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.info("open files limit raised from %d to %d (agent streams and waiting "
                     "clients each hold a socket)", soft, hard)
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit from %d: %s", soft, exc)
    else:
        log.info("open files limit: %d", soft)
    return soft


def tune_gc() -> None:
    """Keep the garbage collector's pauses short with thousands of connections. A full
    collection walks every tracked object (about 110 per agent stream, most of them
    grpc's): with 10,000 streams it took 1 to 3 s here, every few seconds while streams
    kept connecting, and every pause stops the event loop. What start-up built is moved
    out of the collector's sight (``gc.freeze``), and the thresholds are raised so that
    objects living a few seconds (a waiting client's futures) die young instead of
    piling up in the oldest generation, which is walked rarely."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    log.info("garbage collector: %d objects frozen, thresholds %s", gc.get_freeze_count(),
             GC_THRESHOLDS)


def _listen(addr: str) -> socket.socket:
    host, port = _split(addr)
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"cannot listen for HTTP on {addr}: {exc}") from None
    sock.listen(4096)
    sock.setblocking(False)
    return sock


class BrokerServer:
    def __init__(self, settings: Settings, services: Services | None = None, *,
                 migrate: bool | str = True):
        """``migrate``: as for :func:`build_services` (``broker serve`` passes "auto")."""
        self.settings = settings
        try:
            # Checked before anything listens: a bad certificate is an error at start, not
            # a handshake failure on every connection.
            self.cert = (check_server_cert(settings.tls_cert, settings.tls_key)
                         if settings.tls else None)
            if self.cert is None:
                check_plaintext({"REST": settings.http, "gRPC": settings.grpc},
                                settings.insecure)
        except TLSError as exc:
            raise SystemExit(str(exc)) from None
        # One broker process per SQLite file (PostgreSQL takes replicas): refused before
        # anything is built (DatabaseInUse).
        self._serve_lock = hold_serve_lock(settings.db_url)
        try:
            self.services = services or build_services(settings, migrate=migrate)
        except BaseException:
            if self._serve_lock is not None:
                self._serve_lock.close()
            raise
        self.app = create_app(self.services)
        self.http_pool = ThreadPoolExecutor(settings.http_threads, thread_name_prefix="http")
        self.agent_pool = ThreadPoolExecutor(settings.agent_threads,
                                             thread_name_prefix="agent")
        self.health_pool = ThreadPoolExecutor(1, thread_name_prefix="health")
        self.gateway_stats = GatewayStats()
        self._stopped = threading.Event()
        self._done = threading.Event()
        self._http_socket = _listen(settings.http)
        self.http_port = self._http_socket.getsockname()[1]
        self.loop = uvloop.new_event_loop()
        self._loop_thread = threading.Thread(target=self._run_loop, name="broker-io",
                                             daemon=True)
        self._loop_thread.start()
        try:
            self._on_loop(self._setup())
            if self.services.replicas is not None:  # refused here: another signing key
                host = lambda addr: addr.rpartition(":")[0]  # noqa: E731
                self.services.replicas.join(
                    http=f"{host(settings.http)}:{self.http_port}",
                    grpc=f"{host(settings.grpc)}:{self.grpc_port}")
        except BaseException:
            self._close_loop()
            self._http_socket.close()
            self.services.engine.dispose()
            if self._serve_lock is not None:
                self._serve_lock.close()
            raise

    # ---- the event loop ----------------------------------------------------------------
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _on_loop(self, coro, timeout_s: float | None = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _setup(self) -> None:
        svc, settings = self.services, self.settings
        self.grpc_server = grpc.aio.server(options=GRPC_OPTIONS)
        self.gateway = AgentGatewayServicer(
            jobs=svc.jobs, providers=svc.providers, auth=svc.auth, dispatcher=svc.dispatcher,
            signer=svc.signer, heartbeat_interval_s=settings.heartbeat_interval_s,
            lease_timeout_s=settings.lease_timeout_s, market=svc.market,
            canaries=svc.canaries, warm=svc.registry.warm, executor=self.agent_pool,
            max_streams=settings.max_agent_streams, outbox_max=settings.agent_outbox_max,
            stats=self.gateway_stats, links=svc.links,
            telemetry=svc.telemetry)
        pb_grpc.add_AgentGatewayServicer_to_server(self.gateway, self.grpc_server)
        # The standard health service (grpc.health.v1): NOT_SERVING until started, while
        # the database or its schema is not ready, and once the broker drains.
        self.health = grpc_health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.cert is not None:
            creds = grpc.ssl_server_credentials(
                [(self.cert.key_file.read_bytes(), self.cert.cert_file.read_bytes())])
            self.grpc_port = self.grpc_server.add_secure_port(settings.grpc, creds)
        else:
            self.grpc_port = self.grpc_server.add_insecure_port(settings.grpc)
        if self.grpc_port == 0:
            raise SystemExit(f"cannot listen for agents on {settings.grpc}: address in use?")
        svc.metrics.add_collector(self.gateway_stats.collect)
        svc.metrics.add_collector(lambda: agent_families(svc.dispatcher.sessions()))
        self.front = Front(self.app, svc, Pool(self.http_pool, self.loop), self.health_pool,
                           FrontLimits(max_waiting_clients=settings.max_waiting_clients,
                                       max_pool_requests=settings.max_pool_requests),
                           metrics=svc.metrics, count_requests=settings.metrics)
        self.http = uvicorn.Server(uvicorn.Config(
            self.front, http="httptools", ws="none", lifespan="off", interface="asgi3",
            log_config=None, access_log=False, proxy_headers=False, server_header=False,
            headers=[("server", "sparecycles")], timeout_keep_alive=HTTP_IDLE_TIMEOUT_S,
            backlog=4096, timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            ssl_certfile=str(self.cert.cert_file) if self.cert else None,
            ssl_keyfile=str(self.cert.key_file) if self.cert else None))
        if self.cert is not None:
            self.http.config.load()  # builds the TLS context now: a bad pair fails here

    # ---- running -----------------------------------------------------------------------
    def start_background(self) -> None:
        """Start listening to the other replicas, the dispatcher, maintenance and gRPC; HTTP
        starts in :meth:`serve_forever`."""
        if self.services.replicas is not None:
            self.services.replicas.start()
        self.services.bus.start()
        self.services.dispatcher.start()
        self.services.maintenance.start()
        self._on_loop(self.grpc_server.start())
        self._on_loop(self._start_health())

    def serve_forever(self, ready_file: Path | None = None) -> None:
        try:
            self.start_background()
            self._http_task = asyncio.run_coroutine_threadsafe(
                self.http.serve(sockets=[self._http_socket]), self.loop)
            while not self.http.started and not self._http_task.done():
                if self._stopped.wait(0.01):
                    return
            if self._http_task.done():
                self._http_task.result()  # it failed to start: say why
                return
            host = self.settings.http.rpartition(":")[0]
            scheme = "https" if self.cert else "http"
            info = {"http": f"{scheme}://{host}:{self.http_port}",
                    "grpc": f"{self.settings.grpc.rpartition(':')[0]}:{self.grpc_port}",
                    "tls": self.cert is not None,
                    "broker_public_key": self.services.signer.public_key_hex,
                    "db_url": self.settings.db_url if "@" not in self.settings.db_url
                    else "(hidden)"}
            log.info("broker ready: HTTP %s, agents on %s (%s), key %s…", info["http"],
                     info["grpc"], "TLS" if self.cert else "PLAINTEXT",
                     info["broker_public_key"][:16])
            if ready_file:
                tmp = Path(ready_file).with_suffix(".tmp")
                tmp.write_text(json.dumps(info))
                tmp.replace(ready_file)
            self._stopped.wait()
        finally:
            self.stop()

    def drain(self) -> None:
        """Stop taking traffic (``/readyz`` 503 ``draining``, gRPC health NOT_SERVING)
        while everything still runs; :meth:`stop` drains first too."""
        self._on_loop(self._drain())

    def stop(self) -> None:
        if self._stopped.is_set():
            self._done.wait(30)
            return
        self._stopped.set()
        log.info("broker stopping")
        try:
            self._on_loop(self._shutdown(), timeout_s=SHUTDOWN_GRACE_S * 3 + 5)
        except Exception:  # noqa: BLE001 - go on closing the rest
            log.exception("the event loop did not shut down cleanly")
        self.services.stop()
        for pool in (self.http_pool, self.agent_pool, self.health_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        self._close_loop()
        self.services.dispose()
        if self._serve_lock is not None:
            self._serve_lock.close()
        self._done.set()

    async def _set_health(self, status) -> None:
        for service in ("", GATEWAY_SERVICE):
            await self.health.set(service, status)

    async def _watch_health(self) -> None:
        """Keep the gRPC health status what /readyz would say (see broker.api.health)."""
        from broker.api.health import check_ready
        from broker.errors import NotReady

        loop = asyncio.get_running_loop()
        serving = None
        while not self.front.draining:
            try:
                await asyncio.wait_for(loop.run_in_executor(
                    self.health_pool, check_ready, self.services), HEALTH_INTERVAL_S)
                ok = True
            except (NotReady, asyncio.TimeoutError) as exc:
                ok = False
                if serving is not False:
                    log.warning("not ready: %s", getattr(exc, "message", "the database did "
                                                     "not answer in time"))
            if ok != serving and not self.front.draining:
                serving = ok
                await self._set_health(health_pb2.HealthCheckResponse.SERVING if ok
                                       else health_pb2.HealthCheckResponse.NOT_SERVING)
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _start_health(self) -> None:
        self._health_task = asyncio.ensure_future(self._watch_health())

    async def _drain(self) -> None:
        self.front.draining = True
        task = getattr(self, "_health_task", None)
        if task is not None:
            task.cancel()
        await self.health.enter_graceful_shutdown()  # every service NOT_SERVING, for good

    async def _shutdown(self) -> None:
        await self._drain()
        self.http.should_exit = True
        await self.grpc_server.stop(grace=SHUTDOWN_GRACE_S)
        await self.gateway.stop_sweeping()
        task = getattr(self, "_http_task", None)
        if task is not None:
            await asyncio.wait_for(asyncio.wrap_future(task), SHUTDOWN_GRACE_S * 2 + 1)
        else:
            self._http_socket.close()

    def _close_loop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._loop_thread.join(10)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()


def serve(settings: Settings, ready_file: Path | None = None) -> None:
    raise_open_files_limit()
    try:
        server = BrokerServer(settings, migrate="auto")
    except (NotMigrated, DatabaseInUse, ReplicaMismatch, AtRestError) as exc:
        raise SystemExit(f"error: {exc}") from None
    tune_gc()

    def _signal(signum, _frame):
        log.info("received %s", signal.Signals(signum).name)
        threading.Thread(target=server.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, _signal)
    signal.signal(signal.SIGINT, _signal)
    server.serve_forever(ready_file)
