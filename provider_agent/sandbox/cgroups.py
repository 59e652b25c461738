"""Memory, CPU and process-count limits, for the agent as a whole and for each sandbox.

Every plugin host of an agent sits in one **agent group** (``AgentLimits``) that holds what
the agent may take of the machine: a memory budget shared by all its hosts, and a number of
CPU cores (a CFS bandwidth quota). Each sandbox is a child of it with its own memory limit
(at most the budget) and process count. One host per plugin can therefore never add up to
more than the budget, however many plugins the agent serves.

By the best means the machine offers, in this order:

1. **cgroup v2** (current desktops): ``sparecycles-<agent>`` below the agent's own cgroup,
   which must be delegated to the agent's user (systemd does this for user services and
   for ``systemd-run --user --scope -p Delegate=yes``; root may use any cgroup), with
   ``memory.max`` = budget and ``cpu.max``; sandboxes are ``sandbox-<name>`` inside it.
   Because of v2's "no processes in inner nodes" rule, the agent may move itself into a
   ``sparecycles-agent`` leaf next to its group the first time.
2. **cgroup v1**: ``sparecycles/agent-<agent>/<name>`` below the agent's own cgroup in each
   of the ``memory``, ``cpu`` and ``pids`` hierarchies that is writable (typically only as
   root); ``memory.limit_in_bytes`` = budget and ``cpu.cfs_quota_us`` on the agent level.
3. **Nothing writable**: memory is enforced by a ``MemoryWatchdog`` thread that sums the
   resident anonymous + shared memory of the process trees and kills the largest one above
   budget (one for the budget, one per sandbox for its own limit); the process count falls
   back to ``RLIMIT_NPROC`` (counted in the sandbox's own user namespace, so per sandbox);
   the CPU is not limited, and the enforcement report says so.

Each backend answers the same questions: attach processes, kill everything inside, which
limit (if any) was breached, remove.
"""
from __future__ import annotations

import errno
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


_SWAP_DISABLED = "0"
#: CFS bandwidth period (µs); the quota is cores × period, at least the kernel's 1 ms.
CPU_PERIOD_US = 100_000
_MIN_QUOTA_US = 1_000


def cpu_quota_us(cores: float) -> int:
    return max(_MIN_QUOTA_US, int(round(cores * CPU_PERIOD_US)))


# --------------------------------------------------------------------------- discovery

def _mounts(mountinfo: Path) -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of every cgroup mount."""
    out = []
    for line in mountinfo.read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
            out.append((fields[4], rfields[0], set(rfields[2].split(","))))
    return out


def _own_paths(proc_cgroup: Path) -> dict[str, str]:
    """Controller name → this process's cgroup path; the v2 entry is keyed ``""``."""
    out: dict[str, str] = {}
    for line in proc_cgroup.read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for ctl in controllers.split(",") if controllers else [""]:
            out[ctl] = path
    return out


V1_CONTROLLERS = ("memory", "pids", "cpu")


@dataclass
class CgroupLayout:
    """Where this process sits in the cgroup tree(s); read from ``/proc``."""

    v2_dir: Path | None          # our own v2 cgroup, if the v2 hierarchy has memory+pids
    v1_dirs: dict[str, Path]     # controller ("memory", "pids", "cpu") → our own v1 cgroup
    v2_controllers: set[str] = field(default_factory=set)  # what v2_dir offers

    @classmethod
    def detect(cls, proc_self: Path = Path("/proc/self")) -> "CgroupLayout":
        mounts = _mounts(proc_self / "mountinfo")
        own = _own_paths(proc_self / "cgroup")
        v2_dir, v2_ctls = None, set()
        v1_dirs: dict[str, Path] = {}
        for mount_point, fstype, opts in mounts:
            if fstype == "cgroup2" and "" in own:
                candidate = Path(mount_point + own[""].rstrip("/"))
                ctl_file = candidate / "cgroup.controllers"
                try:
                    ctls = set(ctl_file.read_text().split())
                except OSError:
                    continue
                if {"memory", "pids"} <= ctls:
                    v2_dir, v2_ctls = candidate, ctls
            elif fstype == "cgroup":
                for ctl in V1_CONTROLLERS:
                    if ctl in opts and ctl in own:
                        v1_dirs[ctl] = Path(mount_point + own[ctl].rstrip("/"))
        return cls(v2_dir=v2_dir, v1_dirs=v1_dirs, v2_controllers=v2_ctls)


# --------------------------------------------------------------------------- helpers

def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _read_kv(path: Path) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines()
                                       if len(line.split()) == 2)}
    except (OSError, ValueError):
        return {}


def _procs(cg: Path) -> list[int]:
    try:
        return [int(p) for p in (cg / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _kill_procs_until_empty(cg: Path, timeout_s: float = 5.0) -> None:
    """SIGKILL every process of ``cg``, again and again until none is left (a process
    may fork between our read and our kill; the pids limit keeps this finite)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = _procs(cg)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _rmdir(cg: Path, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:  # EBUSY while the killed tasks are being reaped
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _fresh_dir(parent: Path, name: str) -> Path:
    """``parent/name`` created empty (``parent`` too, if need be). One left by an agent
    that was SIGKILLed before its cleanup, under a pid since reused, is replaced: an empty
    cgroup can be removed; one that still holds processes cannot, and the error says so."""
    parent.mkdir(parents=True, exist_ok=True)
    cg = parent / name
    try:
        cg.mkdir()
    except FileExistsError:
        for child in [p for p in cg.iterdir() if p.is_dir()]:
            _rmdir(child)
        cg.rmdir()
        cg.mkdir()
    return cg


def _sweep_stale(parent: Path, prefix: str) -> None:
    """Remove ``<prefix><pid>-…`` groups of agents that are gone (a SIGKILLed agent
    cannot clean up). Only empty ones can go; anything else is left as it is."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for entry in entries:
        name = entry.name
        if not name.startswith(prefix) or not entry.is_dir():
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or Path(f"/proc/{pid}").exists():
            continue
        try:
            for child in [p for p in entry.iterdir() if p.is_dir()]:
                child.rmdir()
            entry.rmdir()
        except OSError:
            pass


def _controllers(text: str) -> set[str]:
    return {c.lstrip("+") for c in text.split()}


def _cores(cores: float) -> str:
    return f"{cores:g} core{'s' if cores != 1 else ''}"


# --------------------------------------------------------------------------- interfaces

class Limits:
    """One sandbox's limits (see module docstring)."""

    #: What enforces each limit, for logs and reports: {"memory": "cgroup v1", …}
    enforcement: dict[str, str]

    def attach(self, pid: int) -> None: ...
    def start(self, root_pid: int) -> None: ...
    def kill_all(self) -> None: ...
    def breached(self) -> str | None: ...
    def remove(self) -> None: ...


class AgentLimits:
    """What all the agent's sandboxes may take together (see module docstring)."""

    #: {"memory": "cgroup v1: 2048 MiB for all hosts", "cpu": "cgroup v1: 1.5 cores", …}
    enforcement: dict[str, str]
    #: The agent group's directory per controller (empty without cgroups), for reports.
    dirs: dict[str, Path]

    def sandbox(self, name: str, memory_limit_mb: int | None, pids_limit: int) -> Limits: ...
    def remove(self) -> None: ...


# --------------------------------------------------------------------------- cgroup v2

class AgentCgroupV2(AgentLimits):
    """``sparecycles-<name>`` with ``memory.max`` (budget), ``memory.swap.max`` = 0 and
    ``cpu.max``, its sandboxes as children (``name``: ``<agent pid>-<n>``)."""

    def __init__(self, own_dir: Path, name: str, memory_budget_mb: int | None,
                 cpu_cores: float | None, available: set[str]) -> None:
        base = own_dir.parent if own_dir.name == "sparecycles-agent" else own_dir
        wanted = ["memory", "pids"] + (["cpu"] if cpu_cores and "cpu" in available else [])
        self._make_inner_node(base, own_dir, wanted)
        _sweep_stale(base, "sparecycles-")
        self.path = _fresh_dir(base, f"sparecycles-{name}")
        self.dirs = {ctl: self.path for ctl in wanted}
        try:
            if memory_budget_mb is not None:
                _write(self.path / "memory.max", str(memory_budget_mb << 20))
                if (self.path / "memory.swap.max").exists():
                    _write(self.path / "memory.swap.max", _SWAP_DISABLED)
            if "cpu" in wanted:
                _write(self.path / "cpu.max", f"{cpu_quota_us(cpu_cores)} {CPU_PERIOD_US}")
            _write(self.path / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
        except OSError:
            self.path.rmdir()
            raise
        self.enforcement = {
            "memory": (f"cgroup v2: {memory_budget_mb} MiB for all hosts"
                       if memory_budget_mb is not None else "none"),
            "cpu": (f"cgroup v2: {_cores(cpu_cores)}" if "cpu" in wanted else
                    "none" if not cpu_cores else
                    f"none: the cpu controller is not delegated to {base}")}

    @staticmethod
    def _make_inner_node(base: Path, own_dir: Path, wanted: list[str]) -> None:
        """Enable ``wanted`` for children of ``base``; if ``base`` holds processes (the
        agent), first move them into a ``sparecycles-agent`` leaf."""
        ctl = base / "cgroup.subtree_control"
        if set(wanted) <= _controllers(ctl.read_text()):
            return
        line = " ".join(f"+{c}" for c in wanted)
        try:
            _write(ctl, line)
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or own_dir != base:
                raise
        leaf = base / "sparecycles-agent"
        leaf.mkdir(exist_ok=True)
        for pid in _procs(base):
            try:
                _write(leaf / "cgroup.procs", str(pid))
            except ProcessLookupError:
                pass
        _write(ctl, line)

    def sandbox(self, name: str, memory_limit_mb: int | None, pids_limit: int) -> Limits:
        return CgroupV2Limits(self.path, name, memory_limit_mb, pids_limit)

    def remove(self) -> None:
        _rmdir(self.path)


class CgroupV2Limits(Limits):
    """One v2 cgroup with ``memory.max``, ``memory.swap.max`` = 0 and ``pids.max``."""

    def __init__(self, parent: Path, name: str, memory_limit_mb: int | None,
                 pids_limit: int) -> None:
        self.path = _fresh_dir(parent, f"sandbox-{name}")
        try:
            if memory_limit_mb is not None:
                _write(self.path / "memory.max", str(memory_limit_mb << 20))
                if (self.path / "memory.swap.max").exists():
                    _write(self.path / "memory.swap.max", _SWAP_DISABLED)
            _write(self.path / "pids.max", str(pids_limit))
        except OSError:
            self.path.rmdir()
            raise
        self.enforcement = {"memory": "cgroup v2" if memory_limit_mb else "none",
                            "pids": "cgroup v2"}

    def attach(self, pid: int) -> None:
        _write(self.path / "cgroup.procs", str(pid))

    def start(self, root_pid: int) -> None:
        pass

    def kill_all(self) -> None:
        kill_file = self.path / "cgroup.kill"
        if kill_file.exists():
            try:
                _write(kill_file, "1")
            except OSError:
                pass
        _kill_procs_until_empty(self.path)

    def breached(self) -> str | None:
        # memory.events counts this group and its children; the agent group's budget,
        # when it is what ran out, shows here too (the kernel kills in the group it picks).
        mem = _read_kv(self.path / "memory.events")
        if mem.get("oom_kill", 0) or mem.get("oom", 0):
            return "memory"
        if _read_kv(self.path / "pids.events").get("max", 0):
            return "pids"
        return None

    def remove(self) -> None:
        _rmdir(self.path)


# --------------------------------------------------------------------------- cgroup v1

class AgentCgroupV1(AgentLimits):
    """``sparecycles/agent-<name>`` in each writable v1 hierarchy: the budget on
    ``memory``, the quota on ``cpu``; a hierarchy that is missing or not writable is
    skipped (memory then falls back to the watchdog, the CPU to no limit)."""

    def __init__(self, own_dirs: dict[str, Path], name: str, memory_budget_mb: int | None,
                 cpu_cores: float | None) -> None:
        self.dirs: dict[str, Path] = {}
        self.budget_watchdog: MemoryWatchdog | None = None
        try:
            for ctl in V1_CONTROLLERS:
                if ctl not in own_dirs or (ctl == "cpu" and not cpu_cores):
                    continue
                top = own_dirs[ctl] / "sparecycles"
                try:
                    _sweep_stale(top, "agent-")
                    self.dirs[ctl] = _fresh_dir(top, f"agent-{name}")
                except PermissionError:
                    continue
            if "memory" in self.dirs:
                cg = self.dirs["memory"]
                hierarchy = cg / "memory.use_hierarchy"
                if hierarchy.exists() and hierarchy.read_text().strip() != "1":
                    _write(hierarchy, "1")  # children are charged to the budget too
                if memory_budget_mb is not None:
                    limit = str(memory_budget_mb << 20)
                    _write(cg / "memory.limit_in_bytes", limit)
                    # memsw = memory + swap; equal to the memory limit means no swap.
                    if (cg / "memory.memsw.limit_in_bytes").exists():
                        _write(cg / "memory.memsw.limit_in_bytes", limit)
                if (cg / "memory.swappiness").exists():
                    _write(cg / "memory.swappiness", "0")
            if "cpu" in self.dirs:
                _write(self.dirs["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(self.dirs["cpu"] / "cpu.cfs_quota_us", str(cpu_quota_us(cpu_cores)))
        except OSError:
            self.remove()
            raise
        if memory_budget_mb is None:
            memory = "none"
        elif "memory" in self.dirs:
            memory = f"cgroup v1: {memory_budget_mb} MiB for all hosts"
        else:
            self.budget_watchdog = MemoryWatchdog(memory_budget_mb)
            memory = f"watchdog: {memory_budget_mb} MiB for all hosts"
        if not cpu_cores:
            cpu = "none"
        elif "cpu" in self.dirs:
            cpu = f"cgroup v1: {_cores(cpu_cores)}"
        else:
            cpu = "none: no writable cpu cgroup (run the agent as root or in a delegated cgroup)"
        self.enforcement = {"memory": memory, "cpu": cpu}

    def sandbox(self, name: str, memory_limit_mb: int | None, pids_limit: int) -> Limits:
        return CgroupV1Limits(self.dirs, name, memory_limit_mb, pids_limit,
                              budget=self.budget_watchdog)

    def remove(self) -> None:
        if self.budget_watchdog:
            self.budget_watchdog.stop()
        for ctl, cg in list(self.dirs.items()):
            _rmdir(cg)
            del self.dirs[ctl]


class CgroupV1Limits(Limits):
    """A ``<name>`` child of the agent group in each of its v1 hierarchies; memory falls
    back to a watchdog and pids to ``RLIMIT_NPROC`` where the hierarchy is missing."""

    def __init__(self, agent_dirs: dict[str, Path], name: str, memory_limit_mb: int | None,
                 pids_limit: int, budget: "MemoryWatchdog | None" = None) -> None:
        self.dirs: dict[str, Path] = {}
        self.enforcement = {}
        self._watchdog: MemoryWatchdog | None = None
        self._budget = budget
        self._root: int | None = None
        try:
            for ctl, parent in agent_dirs.items():
                self.dirs[ctl] = _fresh_dir(parent, name)
            if "memory" in self.dirs and memory_limit_mb is not None:
                cg = self.dirs["memory"]
                limit = str(memory_limit_mb << 20)
                _write(cg / "memory.limit_in_bytes", limit)
                if (cg / "memory.memsw.limit_in_bytes").exists():
                    _write(cg / "memory.memsw.limit_in_bytes", limit)
                if (cg / "memory.swappiness").exists():
                    _write(cg / "memory.swappiness", "0")
                self.enforcement["memory"] = "cgroup v1"
            if "pids" in self.dirs:
                _write(self.dirs["pids"] / "pids.max", str(pids_limit))
                self.enforcement["pids"] = "cgroup v1"
        except OSError:
            self.remove()
            raise
        if memory_limit_mb is None:
            self.enforcement["memory"] = "none"
        elif "memory" not in self.dirs:
            self._watchdog = MemoryWatchdog(memory_limit_mb)
            self.enforcement["memory"] = "watchdog"
        self.enforcement.setdefault("pids", "rlimit")

    def attach(self, pid: int) -> None:
        for cg in self.dirs.values():
            _write(cg / "cgroup.procs", str(pid))

    def start(self, root_pid: int) -> None:
        self._root = root_pid
        if self._watchdog:
            self._watchdog.start(root_pid)
        if self._budget:
            self._budget.start(root_pid)

    def kill_all(self) -> None:
        if self._watchdog:
            self._watchdog.kill_tree()
        if self._budget and self._root is not None:
            self._budget.kill_tree(self._root)
        for ctl in ("memory", "pids", "cpu"):
            if ctl in self.dirs:
                _kill_procs_until_empty(self.dirs[ctl])

    def breached(self) -> str | None:
        if "memory" in self.dirs:
            if _read_kv(self.dirs["memory"] / "memory.oom_control").get("oom_kill", 0):
                return "memory"
        elif self._watchdog and self._watchdog.fired:
            return "memory"
        if self._budget and self._root is not None and self._budget.fired_for(self._root):
            return "memory"
        if "pids" in self.dirs and _read_kv(self.dirs["pids"] / "pids.events").get("max", 0):
            return "pids"
        return None

    def remove(self) -> None:
        if self._watchdog:
            self._watchdog.stop()
        if self._budget and self._root is not None:
            self._budget.forget(self._root)
        for ctl, cg in list(self.dirs.items()):
            _rmdir(cg)
            del self.dirs[ctl]


# --------------------------------------------------------------------------- no cgroups

class AgentWatchdog(AgentLimits):
    """No writable cgroups: one watchdog thread for the budget; no CPU limit."""

    def __init__(self, memory_budget_mb: int | None, cpu_cores: float | None,
                 note: str | None = None) -> None:
        self.dirs = {}
        self.budget_watchdog = MemoryWatchdog(memory_budget_mb) if memory_budget_mb else None
        self.enforcement = {
            "memory": (f"watchdog: {memory_budget_mb} MiB for all hosts"
                       if memory_budget_mb else "none"),
            "cpu": ("none: no writable cpu cgroup (run the agent as root or in a delegated "
                    "cgroup)") if cpu_cores else "none"}
        if note:
            self.enforcement["note"] = note

    def sandbox(self, name: str, memory_limit_mb: int | None, pids_limit: int) -> Limits:
        return WatchdogLimits(memory_limit_mb, budget=self.budget_watchdog)

    def remove(self) -> None:
        if self.budget_watchdog:
            self.budget_watchdog.stop()


class WatchdogLimits(Limits):
    """No writable cgroups: a memory watchdog thread, and ``RLIMIT_NPROC`` for pids."""

    def __init__(self, memory_limit_mb: int | None,
                 budget: "MemoryWatchdog | None" = None) -> None:
        self._watchdog = MemoryWatchdog(memory_limit_mb) if memory_limit_mb else None
        self._budget = budget
        self._root: int | None = None
        self.enforcement = {"memory": "watchdog" if self._watchdog else "none",
                            "pids": "rlimit"}

    def attach(self, pid: int) -> None:
        pass

    def start(self, root_pid: int) -> None:
        self._root = root_pid
        if self._watchdog:
            self._watchdog.start(root_pid)
        if self._budget:
            self._budget.start(root_pid)

    def kill_all(self) -> None:
        if self._watchdog:
            self._watchdog.kill_tree()
        if self._budget and self._root is not None:
            self._budget.kill_tree(self._root)

    def breached(self) -> str | None:
        if self._watchdog and self._watchdog.fired:
            return "memory"
        if self._budget and self._root is not None and self._budget.fired_for(self._root):
            return "memory"
        return None

    def remove(self) -> None:
        if self._watchdog:
            self._watchdog.stop()
        if self._budget and self._root is not None:
            self._budget.forget(self._root)


def make_agent_limits(name: str, memory_budget_mb: int | None, cpu_cores: float | None,
                      layout: CgroupLayout | None = None) -> AgentLimits:
    """The best agent group available to this process (see the module docstring)."""
    layout = layout or CgroupLayout.detect()
    v2_note = None
    if layout.v2_dir is not None:
        try:
            return AgentCgroupV2(layout.v2_dir, name, memory_budget_mb, cpu_cores,
                                 layout.v2_controllers)
        except OSError as exc:
            # Not delegated to us (EACCES), or an inner node we may not reorganise
            # (EBUSY): fall back, and say how to get the real thing in the agent's log.
            v2_note = (f"cgroup v2 at {layout.v2_dir} unusable ({exc.strerror}); for real "
                       "limits run the agent as `systemd-run --user --scope -p Delegate=yes "
                       "sparecycles agent run`")
    if layout.v1_dirs:
        try:
            limits: AgentLimits = AgentCgroupV1(layout.v1_dirs, name, memory_budget_mb,
                                                cpu_cores)
        except OSError as exc:
            return AgentWatchdog(memory_budget_mb, cpu_cores, note=(
                f"cgroup v1 below {sorted(map(str, layout.v1_dirs.values()))} unusable "
                f"({exc.strerror}); limits fall back to the watchdog and rlimits"))
        if v2_note:
            limits.enforcement["note"] = v2_note
        return limits
    return AgentWatchdog(memory_budget_mb, cpu_cores, note=v2_note)


# --------------------------------------------------------------------------- watchdog

def process_tree(root_pid: int, proc: Path = Path("/proc")) -> list[int]:
    """``root_pid`` and all its descendants, from a scan of ``/proc/*/stat`` (raw reads:
    the launcher polls this while bwrap starts, on machines with many processes)."""
    children: dict[int, list[int]] = {}
    base = os.fspath(proc)
    for name in os.listdir(base):
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"{base}/{name}/stat", os.O_RDONLY)
        except OSError:
            continue
        try:
            raw = os.read(fd, 1024)
        except OSError:
            continue
        finally:
            os.close(fd)
        try:
            ppid = int(raw[raw.rindex(b")") + 2:].split(None, 2)[1])
        except (ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def _charged_kb(pid: int) -> int:
    """Anonymous + shared-memory resident set of one process, in KiB.  File-backed pages
    (the mapped torch libraries, weights read by mmap) are not counted: they are
    reclaimable, and counting them would punish every process that imports torch."""
    total = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("RssAnon:", "RssShmem:")):
                total += int(line.split()[1])
    except (OSError, ValueError):
        pass
    return total


class MemoryWatchdog:
    """Kills process trees whose resident memory together goes above budget (the
    no-cgroup fallback): the largest tree goes first, until the rest fits.

    One watchdog may watch one tree (a sandbox's own limit) or several (the agent's
    budget, shared by its sandboxes). Weaker than a cgroup: it samples (every
    ``interval_s``), so a fast allocation can overshoot between samples, and it cannot see
    files written to tmpfs (each writable place is capped by its own size instead).
    """

    def __init__(self, limit_mb: int, interval_s: float = 0.1) -> None:
        self.limit_kb = limit_mb << 10
        self.interval_s = interval_s
        self._roots: set[int] = set()
        self._fired: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def fired(self) -> bool:
        """Whether it has killed any tree."""
        return bool(self._fired)

    def fired_for(self, root_pid: int) -> bool:
        return root_pid in self._fired

    def start(self, root_pid: int) -> None:
        """Watch the tree of ``root_pid`` (and start the thread the first time)."""
        with self._lock:
            self._roots.add(root_pid)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"sandbox-mem-{root_pid}")
                self._thread.start()

    def forget(self, root_pid: int) -> None:
        with self._lock:
            self._roots.discard(root_pid)
            self._fired.discard(root_pid)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                roots = sorted(self._roots - self._fired)
            usage = {}
            for root in roots:
                if Path(f"/proc/{root}").exists():
                    usage[root] = sum(_charged_kb(p) for p in process_tree(root))
            while usage and sum(usage.values()) > self.limit_kb:
                victim = max(usage, key=usage.get)
                self._fired.add(victim)
                self.kill_tree(victim)
                del usage[victim]

    def kill_tree(self, root_pid: int | None = None) -> None:
        """SIGKILL the tree of ``root_pid`` (default: every tree watched)."""
        with self._lock:
            roots = [root_pid] if root_pid is not None else sorted(self._roots)
        for root in roots:
            for pid in reversed(process_tree(root)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread and self._thread is not threading.current_thread():
            self._thread.join(timeout=1)
