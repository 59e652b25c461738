"""Runs the broker: HTTP (waitress) and gRPC in one process sharing one set of services."""
from __future__ import annotations

import json
import logging
import signal
import threading
from concurrent import futures
from pathlib import Path

import grpc
from waitress import create_server

from sdk.protocol import agent_pb2_grpc as pb_grpc

from broker.app import create_app
from broker.gateway.servicer import AgentGatewayServicer
from broker.services import Services, build_services
from broker.settings import Settings

log = logging.getLogger("broker")

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"address {addr!r} must look like HOST:PORT (e.g. 127.0.0.1:8080)")
    return host, int(port)


class BrokerServer:
    def __init__(self, settings: Settings, services: Services | None = None):
        self.settings = settings
        self.services = services or build_services(settings)
        svc = self.services
        self.grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=256,
                                                                  thread_name_prefix="grpc"),
                                       options=GRPC_OPTIONS)
        pb_grpc.add_AgentGatewayServicer_to_server(AgentGatewayServicer(
            jobs=svc.jobs, providers=svc.providers, auth=svc.auth, dispatcher=svc.dispatcher,
            signer=svc.signer, heartbeat_interval_s=settings.heartbeat_interval_s,
            lease_timeout_s=settings.lease_timeout_s, market=svc.market,
            canaries=svc.canaries, warm=svc.registry.warm), self.grpc_server)
        self.grpc_port = self.grpc_server.add_insecure_port(settings.grpc)
        if self.grpc_port == 0:
            raise SystemExit(f"cannot listen for agents on {settings.grpc}: address in use?")
        host, port = _split(settings.http)
        self.app = create_app(svc)
        self.http = create_server(self.app, host=host, port=port,
                                  threads=settings.http_threads, channel_timeout=120,
                                  connection_limit=1000, ident="sparecycles")
        self.http_port = self.http.effective_port
        self._stopped = threading.Event()

    def start_background(self) -> None:
        """Start dispatcher and gRPC; HTTP runs in :meth:`serve_forever`."""
        self.services.dispatcher.start()
        self.services.maintenance.start()
        self.grpc_server.start()

    def serve_forever(self, ready_file: Path | None = None) -> None:
        self.start_background()
        host = self.settings.http.rpartition(":")[0]
        info = {"http": f"http://{host}:{self.http_port}",
                "grpc": f"{self.settings.grpc.rpartition(':')[0]}:{self.grpc_port}",
                "broker_public_key": self.services.signer.public_key_hex,
                "db_url": self.settings.db_url if "@" not in self.settings.db_url else "(hidden)"}
        log.info("broker ready: HTTP %s, agents on %s, key %s…", info["http"], info["grpc"],
                 info["broker_public_key"][:16])
        if ready_file:
            tmp = Path(ready_file).with_suffix(".tmp")
            tmp.write_text(json.dumps(info))
            tmp.replace(ready_file)
        try:
            self.http.run()
        except (OSError, ValueError):
            if not self._stopped.is_set():
                raise
        finally:
            self.stop()

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        log.info("broker stopping")
        self.grpc_server.stop(grace=2).wait(3)
        self.services.dispatcher.stop()
        self.services.maintenance.stop()
        if self.services.verification is not None:
            self.services.verification.close()
        self.http.close()
        # Idle keep-alive connections would keep waitress's loop alive until they time out.
        for channel in list(getattr(self.http, "_map", {}).values()):
            try:
                channel.close()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        self.http.task_dispatcher.shutdown(timeout=2)
        self.services.engine.dispose()


def serve(settings: Settings, ready_file: Path | None = None) -> None:
    server = BrokerServer(settings)

    def _signal(signum, _frame):
        log.info("received %s", signal.Signals(signum).name)
        threading.Thread(target=server.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, _signal)
    signal.signal(signal.SIGINT, _signal)
    server.serve_forever(ready_file)
