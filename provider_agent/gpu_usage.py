"""The agent's GPUs as NVML sees them: the one source that idle detection
(provider_agent.availability), heartbeat telemetry (provider_agent.telemetry) and the
agent's own /metrics (provider_agent.metrics) all read.

A :class:`GpuUsageSource` answers ``sample()`` with one :class:`DeviceUsage` per GPU it
serves: the processes that hold it (pid, name, memory), its utilisation, memory,
temperature, power and power limit; ``available`` is False (``note`` says why) when there
is nothing to read. :class:`NvmlUsageSource` asks NVML (``nvidia-ml-py``), the same
library ``nvidia-smi`` uses, for the agent's own devices only (one agent serves one
device: ``indices`` are its NVML indices, :func:`provider_agent.launch.gpu_indices_for`);
:class:`FakeGpuUsageSource` is set by hand (tests, and devices that exist only in a test);
:func:`only` narrows any source to some devices. ``none_source()`` is what a machine or
device without NVML gets: no devices, so nothing is ever seen as busy and only the
schedule and the owner's presence apply.

Which processes are the agent's own is not this module's business: the caller passes the
pids it owns (its own and its plugin hosts', see :func:`own_pids`) to ``busy_with``.
"""
from __future__ import annotations

import logging
import os
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

log = logging.getLogger("agent")


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str = ""
    used_mb: float = 0.0


@dataclass(frozen=True)
class DeviceUsage:
    """One GPU as seen at one moment (``index``: its NVML index). Unknown figures are
    None: a figure NVML cannot give on this board is never reported as 0."""

    index: int
    name: str = ""
    processes: tuple[GpuProcess, ...] = ()
    utilisation_pct: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None

    def others(self, own_pids: set[int]) -> list[GpuProcess]:
        """The processes on this GPU that are not the agent's."""
        return [p for p in self.processes if p.pid not in own_pids]

    def own_memory_mb(self, own_pids: set[int]) -> float:
        return sum(p.used_mb for p in self.processes if p.pid in own_pids)


class GpuUsageSource(Protocol):
    available: bool  # False: nothing to read (``note`` says why)
    note: str

    def sample(self) -> list[DeviceUsage]:
        """The GPUs this source serves, now (an empty list: none known)."""
        ...


class NvmlUsageSource:
    """NVML's view of the GPUs at ``indices`` (NVML indices; None: every GPU NVML sees):
    compute and graphics processes, utilisation, memory, temperature, power and its limit.
    A figure NVML cannot give on this GPU (a driver, permission or board limit) is None,
    never an error: the rest still counts. Where NVML cannot be read (no library, no
    driver, no such device) ``available`` is False, ``note`` says why, and ``sample()``
    answers []. ``nvml``: the NVML module (``pynvml`` by default; a fake in tests). Thread
    safe: the gate, the heartbeat and the /metrics threads read it."""

    def __init__(self, nvml=None, indices: Sequence[int] | None = None) -> None:
        self.available = False
        self.note = ""
        self._nvml = None
        self._handles: dict[int, object] = {}
        self._names: dict[int, str] = {}
        self._lock = threading.Lock()
        if nvml is None:
            try:
                import pynvml as nvml  # nvidia-ml-py
            except ImportError:
                self.note = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
                return
        try:
            nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded…
            self.note = f"no NVIDIA GPU readable through NVML: {_nvml_error(exc)}"
            return
        self._nvml = nvml
        try:
            count = int(nvml.nvmlDeviceGetCount())
            wanted = list(range(count)) if indices is None else [int(i) for i in indices]
            self._handles = {i: nvml.nvmlDeviceGetHandleByIndex(i)
                             for i in wanted if 0 <= i < count}
        except Exception as exc:  # noqa: BLE001
            self.note = f"no NVIDIA GPU readable through NVML: {_nvml_error(exc)}"
            self.close()
            return
        if not self._handles:
            asked = ", ".join(str(i) for i in wanted) or "none"
            self.note = ("NVML found no NVIDIA GPU on this machine" if not count else
                         f"NVML sees GPU 0 to {count - 1}, not GPU {asked} this agent "
                         "serves (check its device = \"cuda:N\" or CUDA_VISIBLE_DEVICES)")
            self.close()
            return
        self.available = True
        self._names = {i: _text(_try(lambda: nvml.nvmlDeviceGetName(h)) or "")
                       for i, h in self._handles.items()}

    def sample(self) -> list[DeviceUsage]:
        nv = self._nvml
        out = []
        with self._lock:
            if not self.available:
                return []
            for i, h in self._handles.items():
                mem = _try(lambda: nv.nvmlDeviceGetMemoryInfo(h))
                out.append(DeviceUsage(
                    index=i, name=self._names[i], processes=tuple(self._processes(h)),
                    utilisation_pct=_try(lambda: float(nv.nvmlDeviceGetUtilizationRates(h).gpu)),
                    memory_used_bytes=int(mem.used) if mem is not None else None,
                    memory_total_bytes=int(mem.total) if mem is not None else None,
                    temperature_c=_try(lambda: float(nv.nvmlDeviceGetTemperature(
                        h, nv.NVML_TEMPERATURE_GPU))),
                    power_w=_try(lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),  # mW
                    power_limit_w=_try(
                        lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0)))
        return out

    def _processes(self, h) -> list[GpuProcess]:
        nv = self._nvml
        seen: dict[int, GpuProcess] = {}
        for getter in ("nvmlDeviceGetComputeRunningProcesses",
                       "nvmlDeviceGetGraphicsRunningProcesses"):
            for p in _try(lambda: getattr(nv, getter)(h)) or []:
                used = getattr(p, "usedGpuMemory", None)
                mb = used / 2**20 if isinstance(used, int) and used >= 0 else 0.0
                prev = seen.get(p.pid)
                seen[p.pid] = GpuProcess(p.pid, _process_name(p.pid),
                                         mb + (prev.used_mb if prev else 0.0))
        return list(seen.values())

    def close(self) -> None:
        """Let NVML go (once; its init is counted, so other sources keep theirs)."""
        with self._lock:
            nv, self._nvml, self.available = self._nvml, None, False
        if nv is not None:
            try:
                nv.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass


class FakeGpuUsageSource:
    """Devices set by hand: ``set(index, processes=[...], utilisation_pct=...)``."""

    available = True
    note = ""

    def __init__(self, count: int = 1, *, memory_total_bytes: int = 8 << 30) -> None:
        self._lock = threading.Lock()
        self._devices = {i: DeviceUsage(index=i, name=f"Fake GPU {i}", utilisation_pct=0.0,
                                        memory_used_bytes=0,
                                        memory_total_bytes=memory_total_bytes,
                                        temperature_c=40.0, power_w=30.0)
                         for i in range(count)}

    def set(self, index: int, **changes) -> None:
        if "processes" in changes:
            changes["processes"] = tuple(
                p if isinstance(p, GpuProcess) else GpuProcess(*p) if isinstance(p, tuple)
                else GpuProcess(int(p)) for p in changes["processes"])
        with self._lock:
            self._devices[index] = replace(self._devices[index], **changes)

    def sample(self) -> list[DeviceUsage]:
        with self._lock:
            return list(self._devices.values())


class _NoGpus:
    available = False

    def __init__(self, note: str) -> None:
        self.note = note

    def sample(self) -> list[DeviceUsage]:
        return []


def none_source(note: str = "no GPU to read") -> GpuUsageSource:
    """A source with no devices; ``note``: why (a CPU device, no NVML)."""
    return _NoGpus(note)


class _Only:
    """``source`` narrowed to the devices at ``indices``."""

    def __init__(self, source: GpuUsageSource, indices: Sequence[int]) -> None:
        self.source, self.indices = source, frozenset(indices)

    @property
    def available(self) -> bool:
        return self.source.available

    @property
    def note(self) -> str:
        return self.source.note

    def sample(self) -> list[DeviceUsage]:
        return [d for d in self.source.sample() if d.index in self.indices]


def only(source: GpuUsageSource, indices: Sequence[int]) -> GpuUsageSource:
    """``source`` reading only the GPUs at ``indices`` (one agent's device of a machine's:
    a source given for every device, as tests give one)."""
    return _Only(source, indices)


def default_source(indices: Sequence[int] | None = None) -> GpuUsageSource:
    """NVML for the GPUs at ``indices`` (None: all; []: none, a CPU device), or a source
    with none that says why."""
    if indices is not None and not list(indices):
        return none_source("this agent serves no NVIDIA GPU (its device is the CPU)")
    source = NvmlUsageSource(indices=indices)
    if not source.available:
        log.info("GPU figures unavailable (%s): idle detection sees no GPU processes, "
                 "telemetry reports the CPU and memory only", source.note)
    return source


def own_pids(root: int | None = None) -> set[int]:
    """The agent's process and all its descendants (plugin hosts, the sandboxes' children):
    the GPU users that are not the owner."""
    root = os.getpid() if root is None else root
    pids = {root}
    try:
        import psutil

        pids.update(c.pid for c in psutil.Process(root).children(recursive=True))
    except Exception:  # noqa: BLE001 - psutil missing, or a process ending meanwhile
        pass
    return pids


# ---- the owner at the keyboard --------------------------------------------------------------
class PresenceSource(Protocol):
    def idle_s(self) -> float | None:
        """Seconds since the owner last touched this machine; None: unknown."""
        ...


class LogindPresence:
    """systemd-logind's idle hint of the graphical and console sessions (set by the
    desktop's screen saver / idle monitor): the shortest idle time among active sessions,
    0 for an active session that is not idle, None when logind cannot be asked."""

    def __init__(self, clock_monotonic_us=None, loginctl: str = "loginctl") -> None:
        self._now_us = clock_monotonic_us or (lambda: int(_monotonic_raw() * 1e6))
        self.loginctl = loginctl

    def idle_s(self) -> float | None:
        try:
            listed = subprocess.run([self.loginctl, "list-sessions", "--no-legend"],
                                    capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if listed.returncode != 0:
            return None
        best = None
        for line in listed.stdout.splitlines():
            parts = line.split()
            if not parts:
                continue
            props = _loginctl_props(self.loginctl, parts[0])
            if props.get("Active") != "yes" or props.get("Remote") == "yes":
                continue
            if props.get("IdleHint") != "yes":
                return 0.0
            since = int(props.get("IdleSinceHintMonotonic") or 0)
            idle = max(0.0, (self._now_us() - since) / 1e6) if since else 0.0
            best = idle if best is None else min(best, idle)
        return best


class FakePresence:
    def __init__(self, idle_s: float | None = None) -> None:
        self.value = idle_s

    def idle_s(self) -> float | None:
        return self.value


def _loginctl_props(loginctl: str, session: str) -> dict[str, str]:
    try:
        out = subprocess.run([loginctl, "show-session", session, "-p", "Active", "-p",
                              "Remote", "-p", "IdleHint", "-p", "IdleSinceHintMonotonic"],
                             capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _monotonic_raw() -> float:
    import time

    return time.clock_gettime(time.CLOCK_MONOTONIC)


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _try(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - NVMLError_NotSupported and friends
        return None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_error(exc: Exception) -> str:
    name = type(exc).__name__
    text = str(exc) or name
    if "LibraryNotFound" in name or "Library Not Found" in text:
        return "the NVML library (libnvidia-ml.so, from the NVIDIA driver) is not installed"
    if "DriverNotLoaded" in name or "Driver Not Loaded" in text:
        return "the NVIDIA driver is not loaded"
    return text


__all__ = ["DeviceUsage", "FakeGpuUsageSource", "FakePresence", "GpuProcess", "GpuUsageSource",
           "LogindPresence", "NvmlUsageSource", "PresenceSource", "default_source",
           "none_source", "only", "own_pids"]
