"""The agent's own Prometheus ``/metrics`` (``metrics_addr`` in agent.toml, or
``sparecycles agent run --metrics-addr HOST:PORT``; off by default): its GPUs, CPU and
memory read at scrape time, and how long its jobs spent loading, running and uploading.

The same figures reach the broker in heartbeats (broker ``/metrics`` exports them per
provider); this endpoint is for an operator who scrapes their own machines."""
from __future__ import annotations

import logging
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from .telemetry import JobTimes, Telemetry, utilization_ratio

log = logging.getLogger("agent.metrics")

PHASE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class AgentMetrics:
    def __init__(self, telemetry: Telemetry, *, agent_name: str):
        self.telemetry = telemetry
        self.registry = CollectorRegistry(auto_describe=False)
        self.phase = Histogram(
            "sparecycles_agent_job_phase_seconds", "Where this agent's jobs spent their "
            "time: load (adapters, checkpoint), run (the plugin host), upload (outputs and "
            "receipt until the broker's ack), by plugin.", ["plugin", "phase"],
            buckets=PHASE_BUCKETS_S, registry=self.registry)
        self.jobs = Counter("sparecycles_agent_jobs_total", "Jobs this agent finished, by "
                            "plugin and outcome (done, failed, cancelled).",
                            ["plugin", "outcome"], registry=self.registry)
        self.name = agent_name
        self.registry.register(self)
        telemetry.listeners.append(self.job_finished)
        self._server = None

    def job_finished(self, t: JobTimes) -> None:
        self.jobs.labels(t.plugin, t.outcome).inc()
        for phase, seconds in (("load", t.load_s), ("run", t.run_s), ("upload", t.upload_s)):
            if seconds > 0 or phase == "run":
                self.phase.labels(t.plugin, phase).observe(seconds)

    def collect(self):
        """The machine's figures, read now."""
        s = self.telemetry.sample()
        info = GaugeMetricFamily("sparecycles_agent_info", "This agent (always 1); "
                                 "gpu_note says why there is no GPU figure.",
                                 labels=["agent", "gpu_available", "gpu_note"])
        info.add_metric([self.name, str(s.gpu_available).lower(), s.gpu_note], 1)
        yield info
        for name, doc, value in (
                ("sparecycles_agent_cpu_utilization_ratio", "CPU busy, 0..1 over every "
                 "core, since the previous reading.", s.host.cpu_utilization),
                ("sparecycles_agent_cpu_count", "CPU cores.", s.host.cpu_count),
                ("sparecycles_agent_memory_used_bytes", "Memory in use (total less "
                 "available).", s.host.memory_used_bytes),
                ("sparecycles_agent_memory_total_bytes", "Memory installed.",
                 s.host.memory_total_bytes),
                ("sparecycles_agent_load_average", "1-minute load average.",
                 s.host.load_average_1m)):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        for name, doc, read in (
                ("sparecycles_agent_gpu_utilization_ratio", "GPU busy, 0..1 (NVML).",
                 utilization_ratio),
                ("sparecycles_agent_gpu_memory_used_bytes", "GPU memory in use.",
                 lambda gpu: gpu.memory_used_bytes),
                ("sparecycles_agent_gpu_memory_total_bytes", "GPU memory installed.",
                 lambda gpu: gpu.memory_total_bytes),
                ("sparecycles_agent_gpu_temperature_celsius", "GPU temperature.",
                 lambda gpu: gpu.temperature_c),
                ("sparecycles_agent_gpu_power_watts", "GPU power draw.",
                 lambda gpu: gpu.power_w)):
            g = GaugeMetricFamily(name, doc, labels=["gpu", "name"])
            for gpu in s.gpus:  # this agent's device only; a figure NVML cannot give: none
                value = read(gpu)
                if value is not None:
                    g.add_metric([str(gpu.index), gpu.name], value)
            yield g

    def serve(self, addr: str) -> int:
        """Serve /metrics on ``addr`` (HOST:PORT; port 0: any free one) in a daemon
        thread; returns the port."""
        from prometheus_client import start_http_server

        host, _, port = addr.rpartition(":")
        try:
            self._server, _thread = start_http_server(int(port), host.strip("[]") or "127.0.0.1",
                                                      registry=self.registry)
        except OSError as exc:
            raise OSError(f"cannot serve the agent's /metrics on {addr}: {exc}") from None
        bound = self._server.server_address[1]
        log.info("agent metrics on http://%s:%d/metrics", host or "127.0.0.1", bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            threading.Thread(target=self._server.shutdown, daemon=True).start()
            self._server.server_close()
            self._server = None
