"""When the agent may lend its GPU: idle detection, schedules and limits (DESIGN §8).

:class:`Gate` decides, at each look, the state of one device:

- ``available``: the agent asks for and takes work;
- ``owner_active``: another process uses the GPU (NVML's process list), or its
  utilisation is above ``idle_util_pct`` while no job of the agent runs on it, or the owner
  is at the keyboard (``owner_away_s``): the agent stops asking at once;
- ``idle_waiting``: the owner stopped, and the agent waits ``idle_resume_s`` of unbroken
  idleness before asking again;
- ``schedule_closed``: outside every window of ``schedule``;
- ``limit_reached``: today's GPU hours are used up, or the GPU is at its temperature or
  power ceiling, or the agent's own jobs hold more VRAM than ``max_vram_gb``.

Everything reads a :class:`Clock` (wall time for schedules and days, monotonic for
durations), so tests drive it with :class:`FakeClock`. The GPU-hours budget is kept by a
:class:`UsageMeter` per local day, saved to the agent's home so a restart does not reset it.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, tzinfo
from pathlib import Path
from typing import Protocol

from .errors import ConfigError
from .gpu_usage import DeviceUsage, GpuUsageSource, PresenceSource

log = logging.getLogger("agent")

AVAILABLE = "available"
OWNER_ACTIVE = "owner_active"
IDLE_WAITING = "idle_waiting"
SCHEDULE_CLOSED = "schedule_closed"
LIMIT_REACHED = "limit_reached"
STATES = (AVAILABLE, OWNER_ACTIVE, IDLE_WAITING, SCHEDULE_CLOSED, LIMIT_REACHED)
# What happens to running jobs when the owner comes back (``on_owner`` in agent.toml).
OWNER_POLICIES = ("finish", "give_back", "checkpoint")
# Processes that hold a GPU context all the time on a desktop without being "the owner
# using the GPU": display servers and compositors (NVML lists them as graphics processes).
DISPLAY_PROCESSES = ("Xorg", "Xwayland", "gnome-shell", "kwin_wayland", "kwin_x11",
                     "plasmashell", "mutter", "sway", "weston", "gamescope-wl")
# A GPU stopped at its temperature or power ceiling works again only once it is this far
# below it, so that it does not start and stop at every degree around the ceiling.
TEMPERATURE_HYSTERESIS_C = 5.0
POWER_HYSTERESIS = 0.9


class Clock(Protocol):
    def time(self) -> float: ...
    def monotonic(self) -> float: ...
    def tz(self) -> tzinfo | None: ...


class SystemClock:
    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def tz(self) -> tzinfo | None:
        return None  # the machine's local time zone


@dataclass
class FakeClock:
    now: float = 1_800_000_000.0   # epoch seconds
    mono: float = 1000.0
    zone: tzinfo | None = None

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.mono

    def tz(self) -> tzinfo | None:
        return self.zone

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.mono += seconds


# ---- schedules ---------------------------------------------------------------------------
DAY_NAMES = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
DAY_GROUPS = {"daily": set(range(7)), "weekdays": set(range(5)), "weekends": {5, 6}}
_WINDOW = re.compile(r"^(?:(?P<days>[a-z,\-]+)\s+)?(?P<h1>\d{1,2}):(?P<m1>\d{2})\s*-\s*"
                     r"(?P<h2>\d{1,2}):(?P<m2>\d{2})$")
WINDOW_HELP = ('a window looks like "22:00-07:00" (every day), "weekdays 18:00-23:30", '
               '"weekends 00:00-24:00", "mon,wed,fri 09:00-17:00" or "sat-sun 10:00-18:00"; '
               "a window that ends before it starts runs past midnight and belongs to the day "
               "it starts on")


@dataclass(frozen=True)
class Window:
    days: frozenset[int]     # 0 = Monday
    start_min: int           # minutes after midnight
    end_min: int             # may be <= start_min: past midnight

    @classmethod
    def parse(cls, text: str) -> "Window":
        if not isinstance(text, str):
            raise ConfigError(f"schedule entry {text!r} is not a string; {WINDOW_HELP}")
        m = _WINDOW.match(text.strip().lower())
        if m is None:
            raise ConfigError(f"schedule entry {text!r} is not a time window; {WINDOW_HELP}")
        h1, m1, h2, m2 = (int(m[k]) for k in ("h1", "m1", "h2", "m2"))
        if h1 > 23 or m1 > 59 or m2 > 59 or h2 > 24 or (h2 == 24 and m2 != 0):
            raise ConfigError(f"schedule entry {text!r} has a time out of range: hours "
                              "00-23 (24:00 only as an end), minutes 00-59")
        start, end = h1 * 60 + m1, h2 * 60 + m2
        if start == end:
            raise ConfigError(f"schedule entry {text!r} is empty (it starts where it ends); "
                              'for all day give "00:00-24:00"')
        return cls(frozenset(_parse_days(m["days"], text)), start, end)

    def contains(self, when: datetime) -> bool:
        minute = when.hour * 60 + when.minute
        if self.start_min < self.end_min:
            return when.weekday() in self.days and self.start_min <= minute < self.end_min
        # Past midnight: the evening part on its own day, the morning part on the next.
        if minute >= self.start_min:
            return when.weekday() in self.days
        return minute < self.end_min and (when.weekday() - 1) % 7 in self.days


def _parse_days(spec: str | None, text: str) -> set[int]:
    if not spec:
        return set(DAY_GROUPS["daily"])
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if part in DAY_GROUPS:
            out |= DAY_GROUPS[part]
        elif "-" in part:
            a, _, b = part.partition("-")
            if a[:3] not in DAY_NAMES or b[:3] not in DAY_NAMES:
                raise ConfigError(f"schedule entry {text!r}: unknown day range {part!r}; days "
                                  f"are {', '.join(DAY_NAMES)}, or weekdays / weekends / daily")
            i, j = DAY_NAMES.index(a[:3]), DAY_NAMES.index(b[:3])
            out |= {(i + k) % 7 for k in range((j - i) % 7 + 1)}
        elif part[:3] in DAY_NAMES:
            out.add(DAY_NAMES.index(part[:3]))
        else:
            raise ConfigError(f"schedule entry {text!r}: unknown day {part!r}; days are "
                              f"{', '.join(DAY_NAMES)}, or weekdays / weekends / daily")
    return out


@dataclass(frozen=True)
class Schedule:
    windows: tuple[Window, ...] = ()

    @classmethod
    def parse(cls, entries) -> "Schedule":
        if isinstance(entries, str):
            entries = [entries]
        if not isinstance(entries, (list, tuple)):
            raise ConfigError(f"schedule is {entries!r}; give a list of windows, e.g. "
                              '["22:00-07:00", "weekends 00:00-24:00"]')
        return cls(tuple(Window.parse(e) for e in entries))

    def open_at(self, when: datetime) -> bool:
        """No windows: always open."""
        return not self.windows or any(w.contains(when) for w in self.windows)


# ---- rules and the GPU-hours meter ----------------------------------------------------------
@dataclass(frozen=True)
class Rules:
    """The owner's terms, from agent.toml and flags (see AgentConfig)."""

    idle_only: bool = False
    idle_resume_s: float = 60.0
    idle_util_pct: float = 10.0
    idle_ignore_processes: tuple[str, ...] = DISPLAY_PROCESSES
    owner_away_s: float = 0.0
    on_owner: str = "finish"
    checkpoint_wait_s: float = 30.0
    schedule: Schedule = field(default_factory=Schedule)
    max_vram_gb: float = 0.0
    max_gpu_hours_per_day: float = 0.0
    max_temperature_c: float = 0.0
    max_power_w: float = 0.0

    @property
    def watches_gpu(self) -> bool:
        return self.idle_only or bool(self.max_temperature_c or self.max_power_w
                                      or self.max_vram_gb)


class UsageMeter:
    """Seconds of work per (local day, device), saved to ``path`` (JSON) when given. A
    device is counted while a job of the agent runs on it."""

    KEEP_DAYS = 8
    SAVE_EVERY_S = 30.0

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._days: dict[str, dict[str, float]] = {}
        if path is not None and path.exists():
            try:
                data = json.loads(path.read_text())
                self._days = {str(d): {str(k): float(v) for k, v in per.items()}
                              for d, per in data.get("days", {}).items()}
            except (ValueError, AttributeError, OSError) as exc:
                log.warning("%s is unreadable (%s): starting today's GPU hours at 0", path, exc)
        self._saved_at = 0.0

    def add(self, day: str, device: str, seconds: float) -> None:
        with self._lock:
            per = self._days.setdefault(day, {})
            per[device] = per.get(device, 0.0) + seconds
            if len(self._days) > self.KEEP_DAYS:
                for old in sorted(self._days)[:-self.KEEP_DAYS]:
                    del self._days[old]
            due = time.monotonic() - self._saved_at >= self.SAVE_EVERY_S
        if due:
            self.save()

    def seconds(self, day: str, device: str) -> float:
        with self._lock:
            return self._days.get(day, {}).get(device, 0.0)

    def save(self) -> None:
        if self.path is None:
            return
        with self._lock:
            data = json.dumps({"days": self._days}, sort_keys=True)
        self._saved_at = time.monotonic()
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(data)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("could not save GPU hours to %s: %s", self.path, exc)


# ---- the gate ----------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceState:
    device: str          # "cuda:0", or "cpu"
    state: str           # one of STATES
    reason: str = ""     # what a person reads: why it is not available, or "" when it is
    since: float = 0.0   # wall time the state began

    @property
    def available(self) -> bool:
        return self.state == AVAILABLE

    def as_dict(self) -> dict:
        return {"device": self.device, "state": self.state, "reason": self.reason,
                "since": self.since}


class Gate:
    """The state of one device, looked at every ``poll`` (``look``). ``gpu_index`` is the
    NVML index of the GPU watched (None: a CPU device, where only the schedule, the hours
    and the owner's presence apply)."""

    def __init__(self, rules: Rules, *, device: str, gpu_index: int | None,
                 clock: Clock, source: GpuUsageSource, meter: UsageMeter,
                 presence: PresenceSource | None = None) -> None:
        self.rules = rules
        self.device = device
        self.gpu_index = gpu_index
        self.clock = clock
        self.source = source
        self.meter = meter
        self.presence = presence
        self._last_busy: float | None = None   # monotonic: the owner was last seen then
        self._last_look: float | None = None
        self._hot = False      # stopped at the temperature or power ceiling
        self.state = DeviceState(device, AVAILABLE, "", clock.time())
        self.usage: DeviceUsage | None = None

    def day(self) -> str:
        return datetime.fromtimestamp(self.clock.time(), self.clock.tz()).strftime("%Y-%m-%d")

    def hours_today(self) -> float:
        return self.meter.seconds(self.day(), self.device) / 3600.0

    def look(self, *, own_pids: set[int], working: bool) -> DeviceState:
        """Decide the state now. ``working``: a job of the agent runs on this device (its
        time since the last look counts towards today's GPU hours)."""
        mono = self.clock.monotonic()
        if working and self._last_look is not None:
            self.meter.add(self.day(), self.device, max(0.0, mono - self._last_look))
        self._last_look = mono
        state, reason = self._decide(mono, own_pids, working)
        if state != self.state.state or reason != self.state.reason:
            self.state = DeviceState(self.device, state, reason,
                                     self.state.since if state == self.state.state
                                     else self.clock.time())
        return self.state

    def _decide(self, mono: float, own: set[int], working: bool) -> tuple[str, str]:
        r = self.rules
        usage = self._usage() if r.watches_gpu else None
        self.usage = usage
        owner = self._owner_reason(usage, own, working) \
            if r.idle_only or r.owner_away_s else ""
        if owner:
            self._last_busy = mono
            return OWNER_ACTIVE, owner
        if (r.idle_only or r.owner_away_s) and self._last_busy is not None:
            quiet = mono - self._last_busy
            if quiet < r.idle_resume_s:
                return IDLE_WAITING, (f"the owner stopped using the GPU; work resumes after "
                                      f"{r.idle_resume_s:g}s of idleness")
        now = datetime.fromtimestamp(self.clock.time(), self.clock.tz())
        if not r.schedule.open_at(now):
            return SCHEDULE_CLOSED, "outside the schedule's windows"
        if r.max_gpu_hours_per_day and self.hours_today() >= r.max_gpu_hours_per_day:
            return LIMIT_REACHED, (f"{self.hours_today():.2f} of {r.max_gpu_hours_per_day:g} GPU "
                                   "hours used today")
        if usage is not None:
            # Below the ceiling by the hysteresis once stopped at it.
            temp_limit = r.max_temperature_c - (TEMPERATURE_HYSTERESIS_C if self._hot else 0)
            power_limit = r.max_power_w * (POWER_HYSTERESIS if self._hot else 1)
            self._hot = False
            if r.max_temperature_c and usage.temperature_c is not None \
                    and usage.temperature_c >= temp_limit:
                self._hot = True
                return LIMIT_REACHED, (f"GPU at {usage.temperature_c:.0f}°C, ceiling "
                                       f"{r.max_temperature_c:g}°C (work resumes below "
                                       f"{r.max_temperature_c - TEMPERATURE_HYSTERESIS_C:g}°C)")
            if r.max_power_w and usage.power_w is not None and usage.power_w >= power_limit:
                self._hot = True
                return LIMIT_REACHED, (f"GPU draws {usage.power_w:.0f} W, ceiling "
                                       f"{r.max_power_w:g} W")
            if r.max_vram_gb and usage.own_memory_mb(own) / 1024 > r.max_vram_gb:
                return LIMIT_REACHED, (f"the agent's jobs hold {usage.own_memory_mb(own) / 1024:.1f}"
                                       f" GB of VRAM, limit {r.max_vram_gb:g} GB")
        return AVAILABLE, ""

    def _usage(self) -> DeviceUsage | None:
        if self.gpu_index is None:
            return None
        try:
            samples = self.source.sample()
        except Exception as exc:  # noqa: BLE001 - a driver hiccup must not stop the agent
            log.warning("could not read GPU usage: %s", exc)
            return None
        return next((d for d in samples if d.index == self.gpu_index), None)

    def _owner_reason(self, usage: DeviceUsage | None, own: set[int], working: bool) -> str:
        r = self.rules
        if usage is not None and r.idle_only:
            others = [p for p in usage.others(own) if p.name not in r.idle_ignore_processes]
            if others:
                names = ", ".join(f"{p.name or 'pid'} ({p.pid})" for p in others[:3])
                return f"in use by {names}"
            if not working and usage.utilisation_pct is not None \
                    and usage.utilisation_pct >= r.idle_util_pct:
                return (f"{usage.utilisation_pct:.0f}% busy with no job of this agent "
                        f"(threshold {r.idle_util_pct:g}%)")
        if r.owner_away_s and self.presence is not None:
            idle = self.presence.idle_s()
            if idle is not None and idle < r.owner_away_s:
                return f"the owner was active {idle:.0f}s ago (away after {r.owner_away_s:g}s)"
        return ""


def make_gate(cfg, *, device: str, home: Path | None = None, clock: Clock | None = None,
              source: GpuUsageSource | None = None, presence: PresenceSource | None = None,
              meter: UsageMeter | None = None, dev_root: Path = Path("/dev")) -> Gate | None:
    """The gate for one device under ``cfg``'s terms, or None when it sets none (always
    available). The GPU is watched through NVML (this device's only) unless ``source`` is
    given (the agent's, shared with its telemetry); the hours are kept in
    ``<home>/gpu-hours.json``."""
    rules = cfg.rules()
    if not (rules.watches_gpu or rules.schedule.windows or rules.max_gpu_hours_per_day
            or rules.owner_away_s):
        return None
    from .config import config_dir
    from .gpu_usage import LogindPresence, default_source
    from .launch import gpu_indices_for

    gpus = gpu_indices_for(device, dev_root)
    if rules.idle_only and not gpus:
        log.warning("idle_only is set but device %s is no NVIDIA GPU: only the schedule, "
                    "the limits and the owner's presence decide", device)
    if source is None and gpus and rules.watches_gpu:
        source = default_source(gpus)
    if presence is None and rules.owner_away_s:
        presence = LogindPresence()
    folder = Path(home) if home is not None else config_dir()
    return Gate(rules, device=device, gpu_index=gpus[0] if gpus else None,
                clock=clock or SystemClock(), source=source or _NoSource(),
                meter=meter or UsageMeter(folder / "gpu-hours.json"), presence=presence)


class _NoSource:
    def sample(self) -> list[DeviceUsage]:
        return []


__all__ = ["AVAILABLE", "DeviceState", "FakeClock", "Gate", "IDLE_WAITING", "LIMIT_REACHED",
           "OWNER_ACTIVE", "OWNER_POLICIES", "Rules", "SCHEDULE_CLOSED", "Schedule",
           "SystemClock", "UsageMeter", "Window"]
