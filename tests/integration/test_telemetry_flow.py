"""Agent telemetry end to end (issue #25): a real agent reports a (fake-NVML) GPU and this
machine's CPU in its heartbeats; the broker exports it per provider in /metrics and shows
it on the console's provider page; the agent serves its own /metrics."""
from __future__ import annotations

import time

from provider_agent.gpu_usage import NvmlUsageSource
from provider_agent.telemetry import Telemetry
from sdk import Client
from tests.integration.test_metrics import scrape, value
from tests.unit.provider_agent.test_telemetry import GPU, FakeNvml


def _until(check, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError("timed out")


def _has(families, name: str) -> bool:
    return bool(families.get(name))


def test_gpu_telemetry_reaches_metrics_and_console(live_broker, start_agent):
    telemetry = Telemetry(NvmlUsageSource(FakeNvml([GPU])), interval_s=0)
    agent = start_agent("gpu-box", telemetry=telemetry, metrics_addr="127.0.0.1:0")
    with Client(live_broker.url, live_broker.key("client")) as client:
        client.generate("echo", text="timed")
    def reported():
        f = scrape(live_broker.url)
        return f if (_has(f, "sparecycles_provider_gpu_utilization_ratio")
                     and _has(f, "sparecycles_provider_job_phase_seconds")) else None
    m = _until(reported)
    pid = agent.provider_id
    assert value(m, "sparecycles_provider_gpu_utilization_ratio", provider=pid, gpu=0,
                 model="NVIDIA GeForce RTX 4090") == 0.73
    assert value(m, "sparecycles_provider_gpu_memory_total_bytes", provider=pid) == 24 << 30
    assert value(m, "sparecycles_provider_gpu_power_watts", provider=pid) == 287.5
    assert value(m, "sparecycles_provider_memory_total_bytes", provider=pid) > 0
    assert 0 <= value(m, "sparecycles_provider_cpu_utilization_ratio", provider=pid) <= 1

    # The agent's own /metrics (port 0 in its config: a free one).
    local = scrape(f"http://127.0.0.1:{agent.metrics_port}")
    assert value(local, "sparecycles_agent_gpu_temperature_celsius", gpu=0) == 61
    assert value(local, "sparecycles_agent_jobs_total", plugin="echo", outcome="done") >= 1
    assert value(local, "sparecycles_agent_job_phase_seconds_count", plugin="echo",
                 phase="run") >= 1
    assert value(local, "sparecycles_agent_memory_total_bytes") > 0

    # The console's provider page, from the row (the store writes it on the first report).
    row = _until(lambda: live_broker.services.providers.get(pid).telemetry)
    assert row["gpus"][0]["name"] == "NVIDIA GeForce RTX 4090"
    page = _console(live_broker).get(f"/admin/providers/{pid}")
    assert page.status_code == 200
    assert 'id="telemetry"' in page.text and "NVIDIA GeForce RTX 4090" in page.text
    assert "73%" in page.text and "61 °C" in page.text
    listing = _console(live_broker).get("/admin/providers")
    assert "GPU0 73% · 61 °C" in listing.text


def test_without_a_gpu_the_console_says_cpu_only(live_broker, start_agent):
    telemetry = Telemetry(NvmlUsageSource(FakeNvml(missing_library=True)), interval_s=0)
    agent = start_agent("cpu-box", telemetry=telemetry)
    pid = agent.provider_id
    _until(lambda: live_broker.services.providers.get(pid).telemetry)
    m = scrape(live_broker.url)
    assert value(m, "sparecycles_provider_gpus", provider=pid) == 0
    page = _console(live_broker).get(f"/admin/providers/{pid}")
    assert 'id="telemetry-cpu-only"' in page.text and "NVML library" in page.text


def test_a_figure_the_agent_cannot_read_shows_as_unknown(live_broker, start_agent):
    """A NaN temperature and an infinite power draw are neither stored as bounds (300 °C)
    nor exported: the console shows them as unknown."""
    odd = {**GPU, "temp": float("nan"), "mw": float("inf")}
    telemetry = Telemetry(NvmlUsageSource(FakeNvml([odd])), interval_s=0)
    agent = start_agent("odd-box", telemetry=telemetry)
    pid = agent.provider_id
    row = _until(lambda: live_broker.services.providers.get(pid).telemetry)
    assert row["gpus"][0]["temperature_c"] is None and row["gpus"][0]["power_w"] is None
    m = scrape(live_broker.url)
    temperatures = m.get("sparecycles_provider_gpu_temperature_celsius", [])
    assert not [labels for _, labels, _ in temperatures if labels.get("provider") == pid]
    assert value(m, "sparecycles_provider_gpu_utilization_ratio", provider=pid) == 0.73
    page = _console(live_broker).get(f"/admin/providers/{pid}")
    assert page.status_code == 200 and "300 °C" not in page.text
    assert "<td class=\"num\">—</td>" in page.text.split('data-device="gpu0"')[1]
    listing = _console(live_broker).get("/admin/providers")
    assert "GPU0 73% · —" in listing.text


class _Console:
    """An admin signed in to the live broker's console (its own sign-in form)."""

    def __init__(self, broker):
        from tests.integration.test_admin_console_forms import _sign_in

        self.client = broker.server.app.test_client()
        _sign_in(self.client, broker.services)

    def get(self, path: str):
        return self.client.get(path)


def _console(broker) -> _Console:
    return _Console(broker)
