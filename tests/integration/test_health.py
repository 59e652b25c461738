"""The standard gRPC health service on the agent port and /readyz's reasons (issue #25)."""
from __future__ import annotations

import time

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import text

from broker.server import GATEWAY_SERVICE
from tests.integration.conftest import LiveBroker


def _status(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _until(check, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_grpc_health_serves_then_drains(tmp_path):
    broker = LiveBroker(tmp_path)
    try:
        _until(lambda: _status(broker.grpc) == health_pb2.HealthCheckResponse.SERVING)
        assert _status(broker.grpc, GATEWAY_SERVICE) == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(broker.grpc) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
                raise AssertionError("an unknown service must be NOT_FOUND")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND
        ready = httpx.get(f"{broker.url}/readyz", timeout=10).json()
        assert ready["checks"] == {"database": "ok", "migrations": "ok", "draining": False}
        # Draining: /readyz and gRPC health both say so before the listeners go.
        broker.server.drain()
        resp = httpx.get(f"{broker.url}/readyz", timeout=10)
        assert resp.status_code == 503
        assert [r["check"] for r in resp.json()["reasons"]] == ["draining"]
        assert _status(broker.grpc) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        broker.stop()


def test_readyz_names_a_schema_that_is_behind(tmp_path):
    broker = LiveBroker(tmp_path)
    try:
        with broker.services.engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = '0001_spine'"))
        resp = httpx.get(f"{broker.url}/readyz", timeout=10)
        assert resp.status_code == 503
        body = resp.json()
        assert body["code"] == "not_ready"
        assert [r["check"] for r in body["reasons"]] == ["migrations"]
        assert "0001_spine" in body["detail"] and "broker serve" in body["detail"]
    finally:
        broker.stop()
