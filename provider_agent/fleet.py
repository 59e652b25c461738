"""Several GPUs on one machine: one agent per device (DESIGN §8).

Each device gets its own :class:`~provider_agent.agent.Agent`: its own plugin hosts,
sandboxed with that GPU's device nodes only (``/dev/nvidiaN`` and the shared control
nodes), its own benchmark, slots, standing asks, idle detection and GPU hours, and its
own identity key and gRPC stream, so the broker sees one provider per device (all under
the operator's one account: one operator's machines bid as one). The first device keeps
``identity.key`` (its standing survives adding a GPU); device ``cuda:N`` after it uses
``identity-cudaN.key``.

Per device, ``device_slots`` and ``device_asks`` override ``slots`` and ``asks``; the
machine's ``memory_limit_mb`` and ``cpu_cores`` are shared out equally between devices.
A device that fails is taken out, not the machine: one whose sandbox or model cannot
start, or whose plugin host dies under several jobs in a row (``DEVICE_FAILURES_MAX``),
stops; the others go on serving. The fleet ends when every device has stopped, with 0 if
any of them stopped normally (drained, signalled) and 2 if all of them failed.

While it runs, the fleet writes every device's state to ``<home>/status.json`` (0600)
for ``sparecycles agent status``.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from sdk.protocol.signing import KeyPair

from .agent import Agent
from .availability import Clock, UsageMeter, make_gate
from .config import AgentConfig, config_dir, load_identity
from .errors import AgentError, ConfigError
from .gpu_usage import GpuUsageSource, default_source, only
from .host.manager import HostFactory, PluginHost
from .launch import gpu_indices_for, host_launcher
from .telemetry import Telemetry

log = logging.getLogger("agent")
STATUS_EVERY_S = 2.0


def devices_of(cfg: AgentConfig, dev_root: Path = Path("/dev")) -> list[str]:
    """The devices to serve: ``devices`` of agent.toml ("all": every /dev/nvidiaN), else
    the one ``device``."""
    wanted = cfg.devices
    if wanted == ["all"] or wanted == "all":
        found = sorted(int(p.name[6:]) for p in dev_root.glob("nvidia[0-9]*")
                       if p.name[6:].isdigit())
        if not found:
            raise ConfigError(f'devices = ["all"] but {dev_root} has no nvidiaN node: no '
                              'NVIDIA GPU is visible; use device = "cpu" or check nvidia-smi')
        return [f"cuda:{i}" for i in found]
    return list(wanted) or [cfg.device]


def identity_for(device: str, first: bool, home: Path | None) -> KeyPair:
    if first:
        return load_identity(home)
    folder = Path(home) if home is not None else config_dir()
    return KeyPair.load_or_create(folder / f"identity-{device.replace(':', '')}.key")


@dataclass
class DeviceSlot:
    device: str
    agent: Agent | None = None
    error: str = ""                 # why it was taken out ("" while it serves)
    thread: threading.Thread | None = None
    ended: bool = False


@dataclass
class Fleet:
    slots: list[DeviceSlot]
    home: Path | None = None
    status_path: Path | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _writing: threading.Lock = field(default_factory=threading.Lock)

    @property
    def agents(self) -> list[Agent]:
        return [s.agent for s in self.slots if s.agent is not None]

    def install_signal_handlers(self) -> None:
        def on_signal(signum, frame):
            for agent in self.agents:
                agent._on_signal(signum, frame)
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def start(self) -> None:
        for slot in self.slots:
            if slot.agent is None:
                continue
            slot.thread = threading.Thread(target=self._run_one, args=(slot,), daemon=True,
                                           name=f"device-{slot.device}")
            slot.thread.start()
        threading.Thread(target=self._write_status_loop, daemon=True, name="status").start()

    def _run_one(self, slot: DeviceSlot) -> None:
        try:
            slot.agent.run()
            if slot.agent.failed_reason:
                slot.error = slot.agent.failed_reason
        except Exception as exc:  # noqa: BLE001 - one device's failure is not the machine's
            slot.error = str(exc) or type(exc).__name__
            slot.agent.failed_reason = slot.error
            log.error("device %s taken out: %s", slot.device, slot.error)
        finally:
            slot.ended = True

    def run(self) -> int:
        self.start()
        return self.wait()

    def wait(self, timeout_s: float | None = None) -> int:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for slot in self.slots:
            if slot.thread is not None:
                slot.thread.join(None if deadline is None else max(0, deadline - time.monotonic()))
        self._stop.set()
        self.write_status()
        if any(s.agent is not None and not s.error for s in self.slots):
            return 0
        log.error("every device failed: %s", "; ".join(f"{s.device}: {s.error}"
                                                       for s in self.slots))
        return 2

    def stop(self) -> None:
        for agent in self.agents:
            agent.stop()

    def status(self) -> dict:
        devices = []
        for slot in self.slots:
            if slot.agent is not None:
                snap = slot.agent.snapshot()
                if slot.error:
                    snap.update(state="failed", reason=slot.error, connected=False)
            else:
                snap = {"device": slot.device, "state": "failed", "reason": slot.error,
                        "connected": False}
            devices.append(snap)
        return {"pid": os.getpid(), "written_at": time.time(), "devices": devices}

    def write_status(self) -> None:
        if self.status_path is None:
            return
        doc = self.status()
        tmp = self.status_path.with_suffix(".tmp")
        with self._writing:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump(doc, f)
                os.replace(tmp, self.status_path)
            except OSError as exc:
                log.warning("could not write %s: %s", self.status_path, exc)

    def _write_status_loop(self) -> None:
        while not self._stop.wait(STATUS_EVERY_S):
            self.write_status()
        self.write_status()


def build_fleet(cfg: AgentConfig, *, home: Path | None, plugin_dirs: dict[str, Path],
                sandboxed: bool, host_factory: HostFactory = PluginHost,
                make_installer: Callable[[], object] = lambda: None,
                dev_root: Path = Path("/dev"), clock: Clock | None = None,
                source: GpuUsageSource | None = None, devices: list[str] | None = None,
                availability_poll_s: float = 1.0, status: bool = True) -> Fleet:
    """One agent per device of ``cfg`` (or ``devices``). A device whose agent cannot be
    made (its sandbox refuses the device nodes, say) is recorded as taken out; the rest
    are built. ``make_installer``: a fresh registry installer per device (or None)."""
    devices = devices or devices_of(cfg, dev_root)
    several = len(devices) > 1
    folder = Path(home) if home is not None else config_dir()
    meter = UsageMeter(folder / "gpu-hours.json")  # one file, counted per device
    # memory_limit_mb and cpu_cores are for all plugin hosts of the machine: each device's
    # agent gets its share.
    from .launch import default_memory_limit_mb

    n = len(devices)
    memory_mb = max(256, (cfg.memory_limit_mb or default_memory_limit_mb()) // n)
    cores = (cfg.cpu_cores or float(os.cpu_count() or 1)) / n
    slots = []
    for i, device in enumerate(devices):
        slot = DeviceSlot(device)
        slots.append(slot)
        try:
            installer = make_installer()
            launcher = host_launcher(
                sandboxed=sandboxed, home=home, cfg=cfg,
                memory_limit_mb=memory_mb if several else None,
                cpu_cores=cores if several else None,
                gpu_devices=gpu_indices_for(device, dev_root), gpu_dev_root=dev_root,
                registry_root=installer.root if installer is not None else None)
            # One GPU source per device's agent, read by its gate and its telemetry alike:
            # NVML for this device only (or the source given, narrowed to this device).
            gpus = gpu_indices_for(device, dev_root)
            usage = only(source, gpus) if source is not None else default_source(gpus)
            gate = make_gate(cfg, device=device, home=home, clock=clock, source=usage,
                             meter=meter, dev_root=dev_root)
            device_cfg = cfg.for_device(device)
            if several and device_cfg.metrics_addr:
                # one /metrics per device's agent: port, port + 1, … (0: each its own free one)
                host, _, port = device_cfg.metrics_addr.rpartition(":")
                device_cfg.metrics_addr = f"{host}:{int(port) + i if int(port) else 0}"
            slot.agent = Agent(device_cfg, identity_for(device, i == 0, home),
                               plugin_dirs=plugin_dirs,
                               sandboxed=sandboxed, launcher=launcher, home=home,
                               installer=installer, gate=gate,
                               telemetry=Telemetry(
                                   usage, interval_s=device_cfg.telemetry_interval_s),
                               availability_poll_s=availability_poll_s, device=device,
                               name=f"{cfg.name}/{device}" if several else cfg.name,
                               host_factory=host_factory)
        except (AgentError, OSError, ValueError) as exc:
            slot.error = str(exc)
            log.error("device %s taken out: %s", device, exc)
    if not any(s.agent for s in slots):
        raise ConfigError("no device can serve: " + "; ".join(f"{s.device}: {s.error}"
                                                              for s in slots))
    return Fleet(slots, home=home, status_path=(folder / "status.json") if status else None)


__all__ = ["DeviceSlot", "Fleet", "build_fleet", "devices_of"]
