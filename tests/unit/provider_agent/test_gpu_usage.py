"""The GPU-usage sources behind idle detection: NVML's mapping (against an object with
NVML's API, as nvidia-ml-py exposes it) and logind's idle hint (against a loginctl that
answers as systemd's does)."""
from __future__ import annotations

from types import SimpleNamespace

from provider_agent.gpu_usage import GpuProcess, LogindPresence, NvmlUsageSource, own_pids


class NotSupported(Exception):
    pass


class FakeNvml:
    """nvidia-ml-py's calls the source makes, for two GPUs; GPU 1's power is unsupported."""
    NVML_TEMPERATURE_GPU = 0

    def __init__(self):
        self.inited = False

    def nvmlInit(self):
        self.inited = True

    def nvmlShutdown(self):
        self.inited = False

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200" if h == 0 else "NVIDIA RTX 4090"

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=100, usedGpuMemory=2 << 30)] if h == 0 else []

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        # A process in both lists counts once, its memory added; None: unknown memory.
        return ([SimpleNamespace(pid=100, usedGpuMemory=1 << 30),
                 SimpleNamespace(pid=200, usedGpuMemory=None)] if h == 0 else [])

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=87 if h == 0 else 0)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=3 << 30, total=141 << 30)

    def nvmlDeviceGetTemperature(self, h, kind):
        return 64

    def nvmlDeviceGetPowerUsage(self, h):
        if h == 1:
            raise NotSupported("power")
        return 312_000  # mW


def test_nvml_source_maps_processes_and_figures():
    nvml = FakeNvml()
    src = NvmlUsageSource(nvml)
    gpu0, gpu1 = src.sample()
    assert gpu0.name == "NVIDIA H200" and gpu1.name == "NVIDIA RTX 4090"
    by_pid = {p.pid: p for p in gpu0.processes}
    assert set(by_pid) == {100, 200}
    assert by_pid[100].used_mb == 3 * 1024 and by_pid[200].used_mb == 0.0
    assert gpu0.utilisation_pct == 87 and gpu0.power_w == 312.0 and gpu0.temperature_c == 64
    assert gpu0.memory_total_bytes == 141 << 30
    assert gpu1.processes == () and gpu1.power_w is None  # unsupported: unknown, not an error
    assert gpu0.others({100}) == [GpuProcess(200, by_pid[200].name, 0.0)]
    src.close()
    assert not nvml.inited


def test_own_pids_hold_the_agent_and_its_children():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        assert {child.pid, __import__("os").getpid()} <= own_pids()
    finally:
        child.kill()
        child.wait()


def test_logind_idle_hint(tmp_path):
    fake = tmp_path / "loginctl"
    fake.write_text("""#!/bin/sh
if [ "$1" = list-sessions ]; then
  echo "  3 1000 alice seat0 tty2"
  echo "  7 1001 bob   -     pts/1"
  exit 0
fi
case "$2" in
  3) printf 'Active=yes\\nRemote=no\\nIdleHint=yes\\nIdleSinceHintMonotonic=40000000\\n' ;;
  7) printf 'Active=yes\\nRemote=yes\\nIdleHint=no\\nIdleSinceHintMonotonic=0\\n' ;;
esac
""")
    fake.chmod(0o755)
    # alice (local) idle since t=40 s; bob is remote (ssh) and does not count.
    presence = LogindPresence(clock_monotonic_us=lambda: 100_000_000, loginctl=str(fake))
    assert presence.idle_s() == 60.0
    assert LogindPresence(loginctl=str(tmp_path / "missing")).idle_s() is None
