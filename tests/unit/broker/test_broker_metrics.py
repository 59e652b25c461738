"""The broker's metrics and the telemetry store, in-process (issue #25): label values an
agent or a client cannot multiply, reports clamped to what they can be, rows written at a
modest rate."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from broker.observability.metrics import BrokerMetrics
from broker.observability.telemetry import TelemetryStore
from sdk.protocol import agent_pb2 as pb


def samples(metrics: BrokerMetrics) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(metrics.render().decode())
            for s in f.samples}


def test_methods_and_statuses_a_client_sends_do_not_become_labels():
    m = BrokerMetrics(replica="r1")
    m.http_request("(unmatched)", "BREW", 418, 0.001)
    m.http_request("(unmatched)", "GET", 999, 0.001)
    got = samples(m)
    assert got[("sparecycles_http_requests_total",
                (("method", "other"), ("route", "(unmatched)"), ("status", "418")))] == 1
    assert got[("sparecycles_http_requests_total",
                (("method", "GET"), ("route", "(unmatched)"), ("status", "other")))] == 1
    assert got[("sparecycles_broker_info", (("replica", "r1"), ("version", "")))] == 1


class _Rows:
    def __init__(self):
        self.written = []

    def record_telemetry(self, provider_id, telemetry, at):
        self.written.append((provider_id, telemetry, at))


def _report(**kw) -> pb.Telemetry:
    t = pb.Telemetry(cpu_utilization=0.25, memory_total_bytes=8 << 30, gpu_available=True,
                     gpus=[pb.GpuTelemetry(index=0, name="A10", utilization=0.5,
                                           temperature_c=55, power_w=120)])
    for k, v in kw.items():
        setattr(t, k, v)
    return t


def test_reports_are_clamped_and_kept_at_a_modest_rate():
    now = [1000.0]
    rows = _Rows()
    m = BrokerMetrics(replica="r1")
    store = TelemetryStore(rows, registry=m.registry, persist_s=60, clock=lambda: now[0])
    m.add_collector(store.collect)
    bad = _report(cpu_utilization=float("nan"), load_average_1m=-3)
    bad.gpus[0].utilization = 7.0
    bad.gpus[0].temperature_c = float("inf")
    bad.gpus[0].power_w = float("-inf")
    bad.jobs.add(plugin="echo", run_s=0.2, load_s=0.01)
    bad.jobs.add(plugin="made-up-" + "x" * 50, run_s=0.1)
    store.record("p1", "box", bad, plugins={"echo"})
    report, at = store.latest("p1")
    # Out of range: clamped. Not a number or infinite: unknown, never stored as a bound.
    assert report["cpu_utilization"] is None and report["load_average_1m"] == 0
    assert report["gpus"][0]["utilization"] == 1.0
    assert report["gpus"][0]["temperature_c"] is None and report["gpus"][0]["power_w"] is None
    assert len(rows.written) == 1 and at == 1000.0
    assert not any(name in ("sparecycles_provider_gpu_temperature_celsius",
                            "sparecycles_provider_gpu_power_watts",
                            "sparecycles_provider_cpu_utilization_ratio")
                   for name, _ in samples(m))  # the unknown figures: no sample, not a bound
    now[0] += 15
    store.record("p1", "box", _report())
    assert len(rows.written) == 1  # not again within persist_s
    got = samples(m)
    assert got[("sparecycles_provider_gpu_temperature_celsius",
                (("gpu", "0"), ("model", "A10"), ("name", "box"), ("provider", "p1")))] == 55
    assert got[("sparecycles_provider_gpu_utilization_ratio",
                (("gpu", "0"), ("model", "A10"), ("name", "box"), ("provider", "p1")))] == 0.5
    phases = {labels for name, labels in got if name == "sparecycles_provider_job_phase_seconds_count"}
    assert {dict(lbl)["plugin"] for lbl in phases} == {"echo", "other"}
    store.forget("p1")  # the stream ended: the newest report is kept, the series go
    assert rows.written[-1][2] == 1015.0 and store.latest("p1") is None
    assert not any(name.startswith("sparecycles_provider_gpu") for name, _ in samples(m))
