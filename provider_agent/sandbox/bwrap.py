"""Building bubblewrap command lines: the filesystem view, namespaces and device nodes.

Pure functions of a ``SandboxPolicy`` plus a few file descriptors, so the argument lists
can be tested without running anything.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import SandboxPolicyError
from .hostuser import SandboxUser, staging_plan, unusable_sources
from .policy import SandboxPolicy

DROP_SCRIPT = Path(__file__).resolve().with_name("drop_to_user.py")

#: uid/gid of the host process inside the sandbox's own user namespace. Outside it is the
#: user bwrap runs as: the agent's own user, or, when the agent is root, the unprivileged
#: sandbox user (``hostuser``) — never host root.
SANDBOX_UID = 1000
SANDBOX_GID = 1000
SCRATCH = "/scratch"
HOSTNAME = "sparecycles-sandbox"

#: System directories bound read-only (symlinks such as merged-/usr /lib are recreated).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
#: The few pieces of /etc that the dynamic linker, Python and torch read.  Not bound on
#: purpose: hosts, resolv.conf (no network anyway), ssl, passwd/group (generated instead,
#: so that no user names of the provider leak), machine-id.
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/nsswitch.conf",
             "/etc/localtime", "/etc/alternatives", "/etc/nvidia")
#: Extra NVIDIA device nodes a CUDA process needs, besides /dev/nvidiaN.
NVIDIA_SHARED_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
#: What container runtimes (runc, podman) hide of the kernel: masked entries read as empty
#: (a file covered by /dev/null, a directory by an empty read-only tmpfs); read-only ones
#: stay readable but nothing in them can be written, whoever the writer is. Masked /sys
#: entries matter only when /sys is bound (with GPUs). Entries this kernel lacks are skipped.
MASKED_PATHS = ("/proc/acpi", "/proc/asound", "/proc/interrupts", "/proc/kcore",
                "/proc/keys", "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats",
                "/proc/sched_debug", "/proc/scsi", "/sys/firmware",
                "/sys/devices/virtual/powercap")
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
#: The writable places of a sandbox, each a private tmpfs that the host empties of what a
#: job left (provider_agent.host.main.ScratchCleaner). POSIX message queues, the one other
#: named store, are refused by the seccomp filter.
WRITABLE_PLACES = (SCRATCH, "/tmp", "/dev/shm")

PASSWD = (f"root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
          f"sandbox:x:{SANDBOX_UID}:{SANDBOX_GID}:sparecycles plugin host:{SCRATCH}:"
          f"/usr/sbin/nologin\n"
          f"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
GROUP = f"root:x:0:\nsandbox:x:{SANDBOX_GID}:\nnogroup:x:65534:\n"


@dataclass
class BwrapFds:
    """File descriptors bwrap reads at start: the seccomp BPF, generated /etc files, and
    the pipe it blocks on until the agent has attached the limits."""

    seccomp: int | None
    passwd: int
    group: int
    block: int | None = None

    def all(self) -> list[int]:
        return [fd for fd in (self.seccomp, self.passwd, self.group, self.block)
                if fd is not None]


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def gpu_device_args(indices: list[int], dev_root: Path = Path("/dev")) -> list[str]:
    """``--dev-bind`` arguments for the assigned NVIDIA GPUs and the shared control nodes.

    ``/dev/nvidiaN`` must exist for each index; the shared nodes (``nvidiactl``,
    ``nvidia-uvm``, ``nvidia-uvm-tools``, ``nvidia-modeset``) and the MIG capability
    directory ``nvidia-caps`` are added when present.  Nodes are mounted at ``/dev/<name>``
    inside whatever ``dev_root`` is (tests point it at a temporary directory).
    """
    if not indices:
        return []
    args: list[str] = []
    for idx in sorted(set(indices)):
        if not isinstance(idx, int) or idx < 0:
            raise SandboxPolicyError(f"GPU indices are non-negative integers; got {idx!r}")
        node = dev_root / f"nvidia{idx}"
        if not node.exists():
            raise SandboxPolicyError(
                f"GPU {idx} has no device node {node}: check `nvidia-smi -L` for the "
                "indices on this machine and that the NVIDIA driver is loaded")
        args += ["--dev-bind", str(node), f"/dev/nvidia{idx}"]
    for name in (*NVIDIA_SHARED_NODES, "nvidia-caps"):
        node = dev_root / name
        if node.exists():
            args += ["--dev-bind", str(node), f"/dev/{name}"]
    if not (dev_root / "nvidiactl").exists():
        raise SandboxPolicyError(
            f"{dev_root / 'nvidiactl'} is missing: the NVIDIA driver is not loaded "
            "(run nvidia-smi to check), or run without GPUs")
    return args


def _system_args() -> list[str]:
    args: list[str] = []
    for d in SYSTEM_DIRS:
        p = Path(d)
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), d]
        elif p.is_dir():
            args += ["--ro-bind", d, d]
    for f in ETC_FILES:
        if os.path.lexists(f):
            args += ["--ro-bind", f, f]
    return args


def _mask_args(prefix: str) -> list[str]:
    """Masks and read-only binds of ``MASKED_PATHS``/``READONLY_PATHS`` under ``prefix``
    ("/proc" or "/sys"). A read-only path is bound from the agent's own /proc: what a
    sysctl file shows depends on the reader's namespaces, not on the mount."""
    args: list[str] = []
    for path in MASKED_PATHS:
        if not path.startswith(prefix + "/") or not os.path.lexists(path):
            continue
        if os.path.isdir(path):
            args += ["--tmpfs", path, "--remount-ro", path]
        else:
            args += ["--ro-bind", "/dev/null", path]
    for path in READONLY_PATHS:
        if path.startswith(prefix + "/") and os.path.lexists(path):
            args += ["--ro-bind", path, path]
    return args


#: Options whose next argument is a host path that bwrap binds (and so looks up).
_SOURCE_FLAGS = ("--bind", "--ro-bind", "--dev-bind", "--bind-try", "--ro-bind-try",
                 "--dev-bind-try")


def bind_sources(cmd: list[str]) -> tuple[list[str], list[str]]:
    """The host paths a bwrap command binds, and those of them bound as devices."""
    end = cmd.index("--") if "--" in cmd else len(cmd)
    sources, devices = [], []
    for i, arg in enumerate(cmd[:end]):
        if arg in _SOURCE_FLAGS and i + 1 < end:
            sources.append(cmd[i + 1])
            if arg.startswith("--dev-bind"):
                devices.append(cmd[i + 1])
    return sources, devices


def _is_within(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


def _mount_args(policy: SandboxPolicy) -> list[str]:
    """Read-only binds of the Python prefixes and ``ro_paths``, with ``hide_paths`` laid
    over them.  Mounts are applied outermost first, so a bind inside a hidden directory
    (a venv inside the hidden $HOME) shows through, and a hidden path inside a bind (the
    config dir inside the source tree) is covered."""
    binds = [p.resolve() for p in (*policy.python_prefixes, *policy.ro_paths)]
    hides = [p.resolve() for p in policy.hide_paths]
    for b in binds:
        if b in hides:
            raise SandboxPolicyError(
                f"{b} is both bound into the sandbox and in hide_paths; remove it from one")
    for b in binds:
        if not b.exists():
            raise SandboxPolicyError(
                f"{b} is to be bound into the sandbox but does not exist: check the plugin "
                "and weights folders (sparecycles agent plugins list)")
    entries: list[tuple[int, int, Path]] = []
    for b in set(binds):
        entries.append((len(b.parts), 0, b))
    for h in set(hides):
        # A hidden path matters only if something bound would otherwise expose it.
        if os.path.lexists(h) and any(_is_within(h, b) for b in binds):
            entries.append((len(h.parts), 1, h))
    args: list[str] = []
    for _, kind, path in sorted(entries):
        if kind == 0:
            args += ["--ro-bind", str(path), str(path)]
        elif path.is_dir():
            args += ["--tmpfs", str(path), "--remount-ro", str(path)]
        else:
            args += ["--ro-bind", "/dev/null", str(path)]
    return args


def build_command(policy: SandboxPolicy, argv: list[str], fds: BwrapFds,
                  bwrap: str = "bwrap", as_root: bool | None = None) -> list[str]:
    """The full bubblewrap argv for ``argv`` under ``policy``. ``as_root``: bwrap itself
    runs as root (default: this process is root), so capabilities are dropped inside; an
    agent that is root runs bwrap as the sandbox user instead (``dropping_command``)."""
    if not argv:
        raise SandboxPolicyError("nothing to run: argv is empty")
    as_root = os.geteuid() == 0 if as_root is None else as_root
    scratch_bytes = str(policy.scratch_size_mb << 20)
    cmd = [bwrap,
           # Own namespaces for everything: no network at all (not even loopback to the
           # host), own pids, IPC, hostname; own user namespace with an unprivileged uid.
           "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID),
           "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
           "--unshare-cgroup-try", "--hostname", HOSTNAME,
           "--die-with-parent", "--new-session"]
    if as_root:
        cmd += ["--cap-drop", "ALL"]
    cmd += _system_args()
    cmd += ["--ro-bind-data", str(fds.passwd), "/etc/passwd",
            "--ro-bind-data", str(fds.group), "/etc/group"]
    # /tmp is mounted before the binds so that a bound path under /tmp (a test's
    # temporary project, a weights cache) shows through it rather than being covered.
    cmd += ["--size", scratch_bytes, "--perms", "01777", "--tmpfs", "/tmp"]
    cmd += _mount_args(policy)
    cmd += ["--proc", "/proc", *_mask_args("/proc"), "--dev", "/dev",
            "--size", scratch_bytes, "--tmpfs", "/dev/shm",
            "--size", scratch_bytes, "--perms", "0777", "--tmpfs", SCRATCH]
    if policy.gpu_devices:
        cmd += gpu_device_args(policy.gpu_devices, policy.gpu_dev_root)
        cmd += ["--ro-bind", "/sys", "/sys"]  # the CUDA driver reads PCI topology here
        cmd += _mask_args("/sys")
    # The root itself is a tmpfs bwrap made to hold the mount points: freeze it.
    cmd += ["--remount-ro", "/", "--chdir", SCRATCH, "--clearenv"]
    for key, value in sorted(policy.env.items()):
        cmd += ["--setenv", key, value]
    if fds.seccomp is not None:
        cmd += ["--seccomp", str(fds.seccomp)]
    if fds.block is not None:
        cmd += ["--block-fd", str(fds.block)]
    return [*cmd, "--", *map(str, argv)]


def dropping_command(cmd: list[str], user: SandboxUser, deep: list[str] = (),
                     hidden: list[str] = (), rlimits: dict[int, int] | None = None) -> list[str]:
    """``cmd`` (a bwrap command) as root starts it for ``user``: through drop_to_user.py,
    which makes the bound paths reachable (``hostuser.staging_plan``), becomes ``user``
    and executes bwrap. Refuses, saying what to change, a bound path ``user`` could not
    use (a folder it cannot read, a GPU node it cannot open; in the trees of ``deep`` —
    the plugin and its weights — any file but those ``hidden``). ``rlimits`` (resource →
    value) are set before bwrap starts, so everything in the sandbox inherits them."""
    sources, devices = bind_sources(cmd)
    sources = [str(Path(s).resolve()) if not s.startswith("/proc/") else s for s in sources]
    bad = unusable_sources(sources, user, devices=devices, deep=list(deep), skip=list(hidden))
    if bad:
        raise SandboxPolicyError(
            f"plugin hosts run as the unprivileged host user {user}, which could not use "
            f"{'; '.join(bad)}. Make them readable to it (chmod -R o+rX on the folder: "
            "files o+r, folders o+rx; GPU nodes rw, as the NVIDIA driver makes them by "
            "default, or put the user in their group), or set sandbox_user in agent.toml "
            "to a user that can")
    spec = {"uid": user.uid, "gid": user.gid, "groups": list(user.groups or (user.gid,)),
            "plan": [[op.kind, op.path] for op in staging_plan(sources, user)],
            "rlimits": [[res, value] for res, value in (rlimits or {}).items()],
            "argv": cmd}
    return helper_command(spec)


def helper_command(spec: dict) -> list[str]:
    """The command running drop_to_user.py with ``spec`` (isolated: no site, no env)."""
    return [sys.executable, "-I", "-S", str(DROP_SCRIPT), json.dumps(spec)]


@functools.lru_cache(maxsize=8)
def probe(user: SandboxUser | None = None) -> tuple[bool, str]:
    """Run ``true`` in a minimal sandbox with the namespaces we use, as ``user`` when given
    (how a root agent starts hosts); cached per process and user."""
    exe = bwrap_path()
    if exe is None:
        return False, ("bubblewrap is not installed: apt-get install bubblewrap (dnf install "
                       "bubblewrap, pacman -S bubblewrap), or run the agent with --no-sandbox")
    try:
        from .seccomp_filter import build_filter
        build_filter()
    except Exception as exc:  # noqa: BLE001 - the message of SandboxUnavailable says it all
        return False, str(exc)
    cmd = [exe, "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID),
           "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
           "--die-with-parent", "--new-session", *_system_args(),
           "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--", "true"]
    try:
        if user is not None:
            cmd = dropping_command(cmd, user)
    except SandboxPolicyError as exc:
        return False, str(exc)
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"bubblewrap could not start ({exc}); run the agent with --no-sandbox"
    if res.returncode != 0:
        who = f" as the unprivileged user {user}" if user is not None else ""
        return False, (f"bubblewrap does not work{who} here: "
                       f"{res.stderr.strip() or res.returncode}. User namespaces may be "
                       "disabled for unprivileged users (sysctl kernel.unprivileged_userns_clone"
                       "=1 and user.max_user_namespaces > 0, or on Ubuntu 24.04 an AppArmor "
                       "profile for bwrap), or run the agent with --no-sandbox")
    return True, f"bubblewrap at {exe} works" + (f" as {user}" if user is not None else "")
