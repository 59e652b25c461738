"""Who else uses this machine's GPUs: the source the agent's idle detection reads.

A :class:`GpuUsageSource` answers ``sample()`` with one :class:`DeviceUsage` per GPU: the
processes that hold it (pid, name, memory), its utilisation, memory, temperature and
power. :class:`NvmlUsageSource` asks NVML (``nvidia-ml-py``), the same library
``nvidia-smi`` uses; :class:`FakeGpuUsageSource` is set by hand (tests, and devices that
exist only in a test). ``none_source()`` is what a machine without NVML gets: no devices,
so nothing is ever seen as busy and only the schedule and the owner's presence apply.

Which processes are the agent's own is not this module's business: the caller passes the
pids it owns (its own and its plugin hosts', see :func:`own_pids`) to ``busy_with``.

The observability part sends NVML figures in heartbeats through its own telemetry source;
this one is only about deciding when the GPU is free to lend.
"""
from __future__ import annotations

import logging
import os
import subprocess
import threading
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
    """One GPU as seen at one moment. Unknown figures are None."""

    index: int
    name: str = ""
    processes: tuple[GpuProcess, ...] = ()
    utilisation_pct: float | None = None
    memory_used_mb: float | None = None
    memory_total_mb: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None

    def others(self, own_pids: set[int]) -> list[GpuProcess]:
        """The processes on this GPU that are not the agent's."""
        return [p for p in self.processes if p.pid not in own_pids]

    def own_memory_mb(self, own_pids: set[int]) -> float:
        return sum(p.used_mb for p in self.processes if p.pid in own_pids)


class GpuUsageSource(Protocol):
    def sample(self) -> list[DeviceUsage]:
        """The machine's GPUs now (an empty list: none known)."""
        ...


class NvmlUsageSource:
    """NVML's view of every GPU: compute and graphics processes, utilisation, memory,
    temperature, power. A figure NVML cannot give on this GPU (a driver or permission
    limit) is None, never an error: the rest still counts."""

    def __init__(self, nvml=None) -> None:
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py

        self._nvml = nvml
        nvml.nvmlInit()
        self._lock = threading.Lock()
        self._names: dict[int, str] = {}

    @classmethod
    def try_open(cls) -> "NvmlUsageSource | None":
        """The source, or None (logged) where NVML or its library is missing."""
        try:
            return cls()
        except Exception as exc:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, …
            log.info("NVML unavailable (%s): idle detection sees no GPU processes", exc)
            return None

    def sample(self) -> list[DeviceUsage]:
        nv = self._nvml
        out = []
        with self._lock:
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                out.append(DeviceUsage(
                    index=i, name=self._name(i, h), processes=tuple(self._processes(h)),
                    utilisation_pct=_try(lambda: float(nv.nvmlDeviceGetUtilizationRates(h).gpu)),
                    memory_used_mb=_try(lambda: nv.nvmlDeviceGetMemoryInfo(h).used / 2**20),
                    memory_total_mb=_try(lambda: nv.nvmlDeviceGetMemoryInfo(h).total / 2**20),
                    temperature_c=_try(lambda: float(nv.nvmlDeviceGetTemperature(
                        h, nv.NVML_TEMPERATURE_GPU))),
                    power_w=_try(lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0)))
        return out

    def _name(self, i: int, h) -> str:
        if i not in self._names:
            name = _try(lambda: self._nvml.nvmlDeviceGetName(h)) or ""
            self._names[i] = name.decode() if isinstance(name, bytes) else str(name)
        return self._names[i]

    def _processes(self, h) -> list[GpuProcess]:
        nv = self._nvml
        seen: dict[int, GpuProcess] = {}
        for getter in (nv.nvmlDeviceGetComputeRunningProcesses,
                       nv.nvmlDeviceGetGraphicsRunningProcesses):
            for p in _try(lambda: getter(h)) or []:
                used = getattr(p, "usedGpuMemory", None)
                mb = used / 2**20 if isinstance(used, int) and used >= 0 else 0.0
                prev = seen.get(p.pid)
                seen[p.pid] = GpuProcess(p.pid, _process_name(p.pid),
                                         mb + (prev.used_mb if prev else 0.0))
        return list(seen.values())

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


class FakeGpuUsageSource:
    """Devices set by hand: ``set(index, processes=[...], utilisation_pct=...)``."""

    def __init__(self, count: int = 1, *, memory_total_mb: float = 8192.0) -> None:
        self._lock = threading.Lock()
        self._devices = {i: DeviceUsage(index=i, name=f"Fake GPU {i}", utilisation_pct=0.0,
                                        memory_used_mb=0.0, memory_total_mb=memory_total_mb,
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
    def sample(self) -> list[DeviceUsage]:
        return []


def none_source() -> GpuUsageSource:
    return _NoGpus()


def default_source() -> GpuUsageSource:
    return NvmlUsageSource.try_open() or none_source()


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


__all__ = ["DeviceUsage", "FakeGpuUsageSource", "FakePresence", "GpuProcess", "GpuUsageSource",
           "LogindPresence", "NvmlUsageSource", "PresenceSource", "default_source",
           "none_source", "own_pids"]
