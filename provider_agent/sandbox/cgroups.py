"""Memory and process-count limits for one sandbox, by the best means the machine offers.

Order of preference:

1. **cgroup v2** (current desktops): a child of the agent's own cgroup, which must be
   delegated to the agent's user (systemd does this for user services and for
   ``systemd-run --user --scope -p Delegate=yes``; root may use any cgroup).  Because of
   v2's "no processes in inner nodes" rule, the agent may move itself into a
   ``sparecycles-agent`` leaf next to the sandboxes the first time.
2. **cgroup v1**: a ``sparecycles/<name>`` child of the agent's own cgroup in the
   ``memory`` and ``pids`` hierarchies (each used if writable; typically only as root).
3. **Nothing writable**: memory is enforced by ``MemoryWatchdog``, a thread that sums the
   resident anonymous + shared memory of the sandbox's process tree and kills it above
   budget; the process count falls back to ``RLIMIT_NPROC`` (per real user, so weaker).

Every backend answers the same questions: attach processes, kill everything inside,
which limit (if any) was breached, remove.
"""
from __future__ import annotations

import errno
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path


_SWAP_DISABLED = "0"


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


@dataclass
class CgroupLayout:
    """Where this process sits in the cgroup tree(s); read from ``/proc``."""

    v2_dir: Path | None          # our own v2 cgroup, if the v2 hierarchy has memory+pids
    v1_dirs: dict[str, Path]     # controller ("memory", "pids") → our own v1 cgroup

    @classmethod
    def detect(cls, proc_self: Path = Path("/proc/self")) -> "CgroupLayout":
        mounts = _mounts(proc_self / "mountinfo")
        own = _own_paths(proc_self / "cgroup")
        v2_dir = None
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
                    v2_dir = candidate
            elif fstype == "cgroup":
                for ctl in ("memory", "pids"):
                    if ctl in opts and ctl in own:
                        v1_dirs[ctl] = Path(mount_point + own[ctl].rstrip("/"))
        return cls(v2_dir=v2_dir, v1_dirs=v1_dirs)


# --------------------------------------------------------------------------- backends

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


class Limits:
    """Interface of a limits backend (see module docstring)."""

    #: What enforces each limit, for logs and reports: {"memory": "cgroup v1", …}
    enforcement: dict[str, str]

    def attach(self, pid: int) -> None: ...
    def start(self, root_pid: int) -> None: ...
    def kill_all(self) -> None: ...
    def breached(self) -> str | None: ...
    def remove(self) -> None: ...


class CgroupV2Limits(Limits):
    """One v2 cgroup with ``memory.max``, ``memory.swap.max`` = 0 and ``pids.max``."""

    def __init__(self, own_dir: Path, name: str, memory_limit_mb: int | None,
                 pids_limit: int) -> None:
        base = own_dir.parent if own_dir.name == "sparecycles-agent" else own_dir
        self._make_inner_node(base, own_dir)
        self.path = base / f"sandbox-{name}"
        self.path.mkdir()
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

    @staticmethod
    def _make_inner_node(base: Path, own_dir: Path) -> None:
        """Enable memory+pids for children of ``base``; if ``base`` holds processes (the
        agent), first move them into a ``sparecycles-agent`` leaf."""
        ctl = base / "cgroup.subtree_control"
        if {"memory", "pids"} <= set(ctl.read_text().split()):
            return
        try:
            _write(ctl, "+memory +pids")
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
        _write(ctl, "+memory +pids")

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
        mem = _read_kv(self.path / "memory.events")
        if mem.get("oom_kill", 0) or mem.get("oom", 0):
            return "memory"
        if _read_kv(self.path / "pids.events").get("max", 0):
            return "pids"
        return None

    def remove(self) -> None:
        _rmdir(self.path)


class CgroupV1Limits(Limits):
    """A ``sparecycles/<name>`` cgroup in the v1 ``memory`` and/or ``pids`` hierarchy.

    A hierarchy that is missing or not writable is skipped; memory then falls back to the
    watchdog and pids to ``RLIMIT_NPROC``.
    """

    def __init__(self, own_dirs: dict[str, Path], name: str, memory_limit_mb: int | None,
                 pids_limit: int) -> None:
        self.dirs: dict[str, Path] = {}
        self.enforcement = {}
        self._watchdog: MemoryWatchdog | None = None
        try:
            if memory_limit_mb is not None and "memory" in own_dirs:
                cg = self._mkdir(own_dirs["memory"], name)
                if cg is not None:
                    self.dirs["memory"] = cg
                    limit = str(memory_limit_mb << 20)
                    _write(cg / "memory.limit_in_bytes", limit)
                    # memsw = memory + swap; equal to the memory limit means no swap.
                    if (cg / "memory.memsw.limit_in_bytes").exists():
                        _write(cg / "memory.memsw.limit_in_bytes", limit)
                    if (cg / "memory.swappiness").exists():
                        _write(cg / "memory.swappiness", "0")
                    self.enforcement["memory"] = "cgroup v1"
            if "pids" in own_dirs:
                cg = self._mkdir(own_dirs["pids"], name)
                if cg is not None:
                    self.dirs["pids"] = cg
                    _write(cg / "pids.max", str(pids_limit))
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

    @staticmethod
    def _mkdir(own: Path, name: str) -> Path | None:
        try:
            (own / "sparecycles").mkdir(exist_ok=True)
            cg = own / "sparecycles" / name
            try:
                cg.mkdir()
            except FileExistsError:
                # Left by an agent that was SIGKILLed before its cleanup, under a pid that
                # has since been reused. An empty cgroup can be removed; one that still
                # holds processes cannot, and then the error says so.
                cg.rmdir()
                cg.mkdir()
            return cg
        except PermissionError:
            return None

    def attach(self, pid: int) -> None:
        for cg in self.dirs.values():
            _write(cg / "cgroup.procs", str(pid))

    def start(self, root_pid: int) -> None:
        if self._watchdog:
            self._watchdog.start(root_pid)

    def kill_all(self) -> None:
        if self._watchdog:
            self._watchdog.kill_tree()
        for cg in self.dirs.values():
            _kill_procs_until_empty(cg)

    def breached(self) -> str | None:
        if "memory" in self.dirs:
            cg = self.dirs["memory"]
            if _read_kv(cg / "memory.oom_control").get("oom_kill", 0):
                return "memory"
        elif self._watchdog and self._watchdog.fired:
            return "memory"
        if "pids" in self.dirs and _read_kv(self.dirs["pids"] / "pids.events").get("max", 0):
            return "pids"
        return None

    def remove(self) -> None:
        if self._watchdog:
            self._watchdog.stop()
        for ctl, cg in list(self.dirs.items()):
            _rmdir(cg)
            del self.dirs[ctl]


class WatchdogLimits(Limits):
    """No writable cgroups: a memory watchdog thread, and ``RLIMIT_NPROC`` for pids."""

    def __init__(self, memory_limit_mb: int | None) -> None:
        self._watchdog = MemoryWatchdog(memory_limit_mb) if memory_limit_mb else None
        self.enforcement = {"memory": "watchdog" if self._watchdog else "none",
                            "pids": "rlimit"}

    def attach(self, pid: int) -> None:
        pass

    def start(self, root_pid: int) -> None:
        if self._watchdog:
            self._watchdog.start(root_pid)

    def kill_all(self) -> None:
        if self._watchdog:
            self._watchdog.kill_tree()

    def breached(self) -> str | None:
        return "memory" if self._watchdog and self._watchdog.fired else None

    def remove(self) -> None:
        if self._watchdog:
            self._watchdog.stop()


def make_limits(name: str, memory_limit_mb: int | None, pids_limit: int,
                layout: CgroupLayout | None = None) -> Limits:
    """The best backend available to this process (see the module docstring)."""
    layout = layout or CgroupLayout.detect()
    if layout.v2_dir is not None:
        try:
            return CgroupV2Limits(layout.v2_dir, name, memory_limit_mb, pids_limit)
        except OSError as exc:
            # Not delegated to us (EACCES), or an inner node we may not reorganise
            # (EBUSY): fall back, and say how to get the real thing in the agent's log.
            v2_note = (f"cgroup v2 at {layout.v2_dir} unusable ({exc.strerror}); for real "
                       "limits run the agent as `systemd-run --user --scope -p Delegate=yes "
                       "sparecycles agent run`")
    else:
        v2_note = None
    if layout.v1_dirs:
        limits: Limits = CgroupV1Limits(layout.v1_dirs, name, memory_limit_mb, pids_limit)
    else:
        limits = WatchdogLimits(memory_limit_mb)
    if v2_note:
        limits.enforcement["note"] = v2_note
    return limits


# --------------------------------------------------------------------------- watchdog

def process_tree(root_pid: int, proc: Path = Path("/proc")) -> list[int]:
    """``root_pid`` and all its descendants, from a scan of ``/proc/*/stat``."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
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
    """Kills a process tree whose resident memory goes above budget (no-cgroup fallback).

    Weaker than a cgroup: it samples (every ``interval_s``), so a fast allocation can
    overshoot between samples, and it cannot see files written to tmpfs (``/scratch`` is
    capped by its own size instead).
    """

    def __init__(self, limit_mb: int, interval_s: float = 0.1) -> None:
        self.limit_kb = limit_mb << 10
        self.interval_s = interval_s
        self.fired = False
        self._root: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, root_pid: int) -> None:
        self._root = root_pid
        self._thread = threading.Thread(target=self._run, name=f"sandbox-mem-{root_pid}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            pids = process_tree(self._root)
            if not Path(f"/proc/{self._root}").exists():
                return
            if sum(_charged_kb(p) for p in pids) > self.limit_kb:
                self.fired = True
                self.kill_tree()
                return

    def kill_tree(self) -> None:
        if self._root is None:
            return
        for pid in reversed(process_tree(self._root)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread and self._thread is not threading.current_thread():
            self._thread.join(timeout=1)
