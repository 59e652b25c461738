"""Agent telemetry (issue #25): NVML through the agent's one GPU source
(provider_agent.gpu_usage), over a fake NVML module here and the real library where a GPU
exists, for the agent's own device only; psutil's figures of this machine."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from provider_agent.gpu_usage import FakeGpuUsageSource, NvmlUsageSource, none_source
from provider_agent.telemetry import HostSource, JobTimes, Telemetry, to_proto
from sdk.protocol import agent_pb2 as pb


class NVMLError_LibraryNotFound(Exception):  # noqa: N801 - pynvml's own class name
    pass


class NVMLError_NotSupported(Exception):  # noqa: N801
    pass


class FakeNvml:
    """The part of pynvml the agent calls, over made-up devices."""
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, devices=(), missing_library=False, no_power=False):
        self.devices = list(devices)
        self.missing_library = missing_library
        self.no_power = no_power
        self.shut = False

    def nvmlInit(self):  # noqa: N802
        if self.missing_library:
            raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    def nvmlShutdown(self):  # noqa: N802
        self.shut = True

    def nvmlDeviceGetCount(self):  # noqa: N802
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802
        return self.devices[i]

    def nvmlDeviceGetName(self, h):  # noqa: N802
        return h["name"].encode()  # older pynvml answers bytes

    def nvmlDeviceGetUtilizationRates(self, h):  # noqa: N802
        return SimpleNamespace(gpu=h["util"], memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):  # noqa: N802
        return SimpleNamespace(used=h["used"], total=h["total"], free=h["total"] - h["used"])

    def nvmlDeviceGetTemperature(self, h, sensor):  # noqa: N802
        assert sensor == self.NVML_TEMPERATURE_GPU
        return h["temp"]

    def nvmlDeviceGetPowerUsage(self, h):  # noqa: N802
        if self.no_power:
            raise NVMLError_NotSupported("Not Supported")
        return h["mw"]

    def nvmlDeviceGetEnforcedPowerLimit(self, h):  # noqa: N802
        return 450_000


GPU = {"name": "NVIDIA GeForce RTX 4090", "util": 73, "used": 6 << 30, "total": 24 << 30,
       "temp": 61, "mw": 287_500}


A10 = {**GPU, "name": "NVIDIA A10", "util": 0}


def test_nvml_source_reads_every_device_without_indices():
    nvml = FakeNvml([GPU, A10])
    src = NvmlUsageSource(nvml)
    assert src.available and src.note == ""
    first, second = src.sample()
    assert first.name == "NVIDIA GeForce RTX 4090" and second.name == "NVIDIA A10"
    assert first.utilisation_pct == pytest.approx(73)
    assert (first.memory_used_bytes, first.memory_total_bytes) == (6 << 30, 24 << 30)
    assert first.temperature_c == 61 and first.power_w == pytest.approx(287.5)
    assert first.power_limit_w == pytest.approx(450.0)
    assert second.index == 1 and second.utilisation_pct == 0
    msg = to_proto(Telemetry(src, interval_s=0).due(), pb)
    assert msg.gpus[0].utilization == pytest.approx(0.73) and len(msg.gpus) == 2
    src.close()
    assert nvml.shut


def test_the_agents_source_reads_its_own_device_only():
    """One agent serves one GPU: the source for ``cuda:1`` reads GPU 1, so a machine's GPUs
    are each reported once, by the agent serving it; a GPU NVML does not have says so."""
    src = NvmlUsageSource(FakeNvml([GPU, A10]), indices=[1])
    (only,) = src.sample()
    assert only.index == 1 and only.name == "NVIDIA A10"
    msg = to_proto(Telemetry(src, interval_s=0).due(), pb)
    assert [(g.index, g.name) for g in msg.gpus] == [(1, "NVIDIA A10")]
    missing = NvmlUsageSource(FakeNvml([GPU, A10]), indices=[5])
    assert not missing.available and missing.sample() == []
    assert "GPU 5" in missing.note and "0 to 1" in missing.note


def test_each_devices_agent_reports_its_own_gpu_and_its_gate_reads_the_same(tmp_path):
    from provider_agent.config import AgentConfig
    from provider_agent.fleet import build_fleet

    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    machine = FakeGpuUsageSource(2)
    cfg = AgentConfig(broker="127.0.0.1:9", api_key="sc_provider_x_y", name="rig",
                      plugins=["echo"], devices=["cuda:0", "cuda:1"], idle_only=True)
    fleet = build_fleet(cfg, home=tmp_path / "home", plugin_dirs={}, sandboxed=False,
                        dev_root=dev, source=machine, status=False)
    for i, agent in enumerate(fleet.agents):
        assert [g.index for g in agent.telemetry.sample().gpus] == [i]
        assert [g.index for g in agent.gate.source.sample()] == [i]


def test_a_figure_the_board_does_not_support_is_unknown_not_zero():
    src = NvmlUsageSource(FakeNvml([GPU], no_power=True))
    (gpu,) = src.sample()
    assert gpu.power_w is None and gpu.temperature_c == 61
    (wire,) = to_proto(Telemetry(src, interval_s=0).due(), pb).gpus
    assert math.isnan(wire.power_w) and wire.temperature_c == 61  # the broker: unknown


@pytest.mark.parametrize("nvml, says", [
    (FakeNvml(missing_library=True), "NVML library"),
    (FakeNvml([]), "found no NVIDIA GPU"),
])
def test_without_a_gpu_it_reports_cpu_and_says_why(nvml, says):
    t = Telemetry(NvmlUsageSource(nvml), interval_s=0)
    sample = t.due()
    assert not sample.gpu_available and sample.gpus == []
    assert says in sample.gpu_note
    assert sample.host.memory_total_bytes > 0
    msg = to_proto(sample, pb)
    assert not msg.gpu_available and says in msg.gpu_note and msg.cpu_count >= 1


def test_psutil_figures_of_this_machine():
    import os

    h = HostSource().read()
    assert 0.0 <= h.cpu_utilization <= 1.0
    assert h.cpu_count == (os.cpu_count() or 1)
    assert 0 < h.memory_used_bytes < h.memory_total_bytes
    assert h.load_average_1m >= 0


def test_reports_come_at_most_once_per_interval_with_the_jobs_since_the_last():
    now = [100.0]
    t = Telemetry(none_source("test"), interval_s=15, monotonic=lambda: now[0])
    t.job_finished(JobTimes("j1", "echo", load_s=0.1, run_s=0.5, upload_s=0.02,
                            request_id="req-1"))
    first = t.due()
    assert [j.job_id for j in first.jobs] == ["j1"]
    now[0] += 5
    assert t.due() is None  # too soon
    t.job_finished(JobTimes("j2", "echo", outcome="failed"))
    now[0] += 10
    second = t.due()
    assert [(j.job_id, j.outcome) for j in second.jobs] == [("j2", "failed")]
    msg = to_proto(first, pb)
    assert msg.jobs[0].request_id == "req-1" and msg.jobs[0].run_s == pytest.approx(0.5)


@pytest.mark.gpu
def test_real_nvml_on_a_gpu_machine():
    pytest.importorskip("pynvml")
    src = NvmlUsageSource()
    if not src.available:
        pytest.skip(f"no GPU readable here: {src.note}")
    gpus = src.sample()
    assert gpus, "NVML saw a device but read none"
    for g in gpus:
        assert g.name and 0.0 <= g.utilisation_pct <= 100.0
        assert 0 < g.memory_total_bytes and 0 <= g.memory_used_bytes <= g.memory_total_bytes
        assert 0 < g.temperature_c < 120
        assert g.power_w is None or g.power_w >= 0
    last = gpus[-1].index  # the agent serving that device alone reads that one alone
    one = NvmlUsageSource(indices=[last])
    assert [g.index for g in one.sample()] == [last]
    one.close()
    src.close()
