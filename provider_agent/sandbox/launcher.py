"""``Sandbox``: start a plugin host under bubblewrap, seccomp, cgroups and rlimits.

Start-up sequence of ``popen``:

1. build the seccomp BPF and the generated ``/etc/passwd``/``group`` into memfds;
2. start ``bwrap … --block-fd R -- argv``: bwrap sets up the namespaces and mounts, then
   waits on the pipe *before* executing the host. When this process is root, bwrap is
   started through ``drop_to_user.py`` as the unprivileged sandbox user (``hostuser``), so
   that no process of the sandbox is host root;
3. move every process bwrap has made so far into the sandbox's cgroup(s) (children of the
   agent group, ``cgroups.AgentLimits``) and set the rlimits on them with ``prlimit``
   (children inherit both; as root, the per-process rlimits came with the drop, and
   ``RLIMIT_NPROC`` is set now, inside bwrap's user namespace, to count per sandbox);
4. write to the pipe: bwrap installs the seccomp filter and executes the host.

Doing the cgroup and rlimit steps from the agent rather than in a ``preexec_fn`` keeps
``popen`` safe in the agent's multi-threaded process (``preexec_fn`` can deadlock there),
and no host code ever runs outside its limits.
"""
from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import time

from . import bwrap
from .cgroups import AgentLimits, Limits, make_agent_limits, process_tree
from .errors import SandboxError, SandboxLimitError, SandboxUnavailable
from .hostuser import SandboxUser
from .policy import SandboxPolicy
from .seccomp_filter import bpf_memfd

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _data_memfd(name: str, text: str) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, text.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def host_user(user: SandboxUser | None = None) -> SandboxUser | None:
    """The host user sandboxes run as from this process: ``user`` (default: the
    dedicated sandbox user, else nobody) when this process is root; None otherwise (bwrap
    then runs as this process's own, unprivileged user)."""
    if os.geteuid() != 0:
        if user is not None and user.uid != os.geteuid():
            raise SandboxError(f"only root can start sandboxes as {user}; this agent runs as "
                               f"uid {os.geteuid()}: leave sandbox_user empty")
        return None
    return user or SandboxUser.resolve()


class Sandbox:
    """One sandboxed process tree (a plugin host) with its limits.

    ``name`` must be unique among the agent's live sandboxes (it names the cgroup).
    ``agent_limits`` is the group all of the agent's sandboxes share (its memory budget and
    CPU cores); without one, the sandbox makes a group of its own (its memory limit, no CPU
    limit). ``user``: the host user to run as when this process is root (default: see
    ``host_user``). Use ``popen`` once; ``kill`` and ``cleanup`` may be called any number
    of times.
    """

    def __init__(self, policy: SandboxPolicy, name: str, *,
                 agent_limits: AgentLimits | None = None,
                 user: SandboxUser | None = None) -> None:
        if not _NAME_RE.match(name):
            raise SandboxError(
                f"sandbox name {name!r} must be 1-64 letters, digits, '.', '_' or '-'")
        self.policy = policy
        self.name = name
        self.user = host_user(user)
        self.process: subprocess.Popen | None = None
        self._agent = agent_limits
        self._own_agent: AgentLimits | None = None
        self._limits: Limits | None = None
        self._fds: bwrap.BwrapFds | None = None
        self._breach: str | None = None

    # ----------------------------------------------------------------- static checks

    @staticmethod
    def available(user: SandboxUser | None = None) -> tuple[bool, str]:
        """Whether bubblewrap and seccomp work here (as the sandbox user, when this
        process is root), and why not (what to do next)."""
        try:
            who = host_user(user)
        except SandboxError as exc:
            return False, str(exc)
        return bwrap.probe(who)

    # ----------------------------------------------------------------- starting

    def command(self, argv: list[str], block_fd: int | None = None) -> list[str]:
        """The full command line for ``argv``: bubblewrap's, or as root the
        ``drop_to_user.py`` one that starts bubblewrap as the sandbox user.

        It names file descriptors (the seccomp filter, generated /etc files) that this
        call opens and ``popen`` passes to bwrap; a ``command`` that is only printed
        leaves them open until ``cleanup``.
        """
        exe = bwrap.bwrap_path()
        if exe is None:
            raise SandboxUnavailable(bwrap.probe()[1])
        self._close_fds()
        self._fds = bwrap.BwrapFds(seccomp=bpf_memfd(),
                                   passwd=_data_memfd("passwd", bwrap.PASSWD),
                                   group=_data_memfd("group", bwrap.GROUP), block=block_fd)
        cmd = bwrap.build_command(self.policy, argv, self._fds, bwrap=exe,
                                  as_root=os.geteuid() == 0 and self.user is None)
        if self.user is None:
            return cmd
        per_process = {res: value for res, value in self._rlimits().items()
                       if res != resource.RLIMIT_NPROC}
        return bwrap.dropping_command(cmd, self.user,
                                      deep=[str(p.resolve()) for p in self.policy.ro_paths],
                                      hidden=[str(p.resolve()) for p in self.policy.hide_paths],
                                      rlimits=per_process)

    def _rlimits(self) -> dict[int, int]:
        p = self.policy
        # Never RLIMIT_AS: CUDA reserves terabytes of virtual address space.
        return {resource.RLIMIT_NOFILE: p.nofile_limit,
                resource.RLIMIT_FSIZE: p.fsize_limit_mb << 20,
                resource.RLIMIT_NPROC: p.pids_limit,
                resource.RLIMIT_CORE: 0}

    def popen(self, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` inside the sandbox and return its ``Popen`` (the pid is bwrap's).

        ``popen_kwargs`` go to ``subprocess.Popen`` (stdin/stdout/stderr, text, …);
        ``env``, ``cwd`` and ``preexec_fn`` are refused: the policy decides those.
        """
        if self.process is not None:
            raise SandboxError(f"sandbox {self.name!r} already runs pid {self.process.pid}; "
                               "create a new Sandbox for a new host")
        for key in ("env", "cwd", "preexec_fn"):
            if key in popen_kwargs:
                raise SandboxError(f"popen({key}=…) is not allowed: set it in SandboxPolicy")
        ok, reason = self.available(self.user)
        if not ok:
            raise SandboxUnavailable(reason)
        agent = self._agent
        if agent is None:
            agent = self._own_agent = make_agent_limits(self.name, self.policy.memory_limit_mb,
                                                        None)
        self._limits = agent.sandbox(self.name, self.policy.memory_limit_mb,
                                     self.policy.pids_limit)
        block_r, block_w = os.pipe()
        try:
            cmd = self.command(argv, block_fd=block_r)
            assert self._fds is not None
            pass_fds = {*self._fds.all(), *popen_kwargs.pop("pass_fds", ())}
            self.process = subprocess.Popen(cmd, env={}, pass_fds=sorted(pass_fds), cwd="/",
                                            start_new_session=True, **popen_kwargs)
        except BaseException:
            os.close(block_w)
            self._limits.remove()
            self._limits = None
            self._remove_own_agent()
            raise
        finally:
            owned = self._fds is not None and self._fds.block == block_r
            self._close_fds()  # bwrap holds its own copies now
            if not owned:
                os.close(block_r)
        try:
            self._attach_when_blocked()
            os.write(block_w, b"g")
        except BaseException:
            self.kill()
            raise
        finally:
            os.close(block_w)
        return self.process

    def _attach_when_blocked(self) -> None:
        """Put every process bwrap has made into the limits and set their rlimits.

        bwrap forks once (the new pid namespace's init) before blocking; we wait until
        that process exists so that it, too, is attached.
        """
        assert self.process is not None and self._limits is not None
        deadline = time.monotonic() + 10
        pids = process_tree(self.process.pid)
        while len(pids) < 2 and self.process.poll() is None:
            if time.monotonic() > deadline:
                raise SandboxError("bubblewrap did not reach its start point within 10 s")
            time.sleep(0.001)
            pids = process_tree(self.process.pid)
        if self.process.poll() is not None:
            err = self.process.stderr.read() if self.process.stderr else b""
            raise SandboxError(f"bubblewrap exited with {self.process.returncode} before "
                               f"starting the host: {err!r}")
        rlimits = self._rlimits()
        if self.user is not None:
            # The per-process limits came with drop_to_user.py. RLIMIT_NPROC only now:
            # set before bwrap made its user namespace, it would count every sandbox of
            # the sandbox user together; set in it, it counts this sandbox's processes.
            rlimits = {resource.RLIMIT_NPROC: rlimits[resource.RLIMIT_NPROC]}
        refused = []
        for pid in pids:
            try:
                self._limits.attach(pid)
                for res, value in rlimits.items():
                    resource.prlimit(pid, res, (value, value))
            except PermissionError as exc:
                if self.user is None:
                    raise SandboxLimitError(
                        f"could not limit sandbox process {pid}: {exc}. Is bwrap setuid on "
                        "this machine? Install a non-setuid bubblewrap or run the agent as "
                        "root") from exc
                refused.append(pid)  # root without CAP_SYS_RESOURCE: set them as the user
            except ProcessLookupError:
                continue
        if refused and not self._limits.enforcement.get("pids", "").startswith("cgroup"):
            self._prlimit_as_user(refused, rlimits)  # else the pids cgroup is the limit
        self._limits.start(self.process.pid)

    def _prlimit_as_user(self, pids: list[int], rlimits: dict[int, int]) -> None:
        """Set ``rlimits`` on ``pids`` from a helper running as the sandbox user (same uid
        and gid as the sandbox's processes, which the kernel lets change their limits)."""
        assert self.user is not None
        spec = {"uid": self.user.uid, "gid": self.user.gid,
                "groups": list(self.user.groups or (self.user.gid,)),
                "prlimit": [[pid, [[res, value] for res, value in rlimits.items()]]
                            for pid in pids]}
        res = subprocess.run(bwrap.helper_command(spec), capture_output=True, text=True,
                             env={}, cwd="/", timeout=20)
        if res.returncode != 0:
            raise SandboxLimitError(f"could not set the rlimits of the sandbox processes "
                                    f"{pids}: {res.stderr.strip() or res.returncode}")

    # ----------------------------------------------------------------- stopping

    def kill(self) -> None:
        """SIGKILL every process of the sandbox (and bwrap itself); waits for bwrap."""
        if self._limits is not None:
            self._limits.kill_all()
        if self.process is not None:
            if self.process.poll() is None:
                for pid in reversed(process_tree(self.process.pid)):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def cleanup(self) -> None:
        """Kill everything left, remember whether a limit was breached, remove the cgroup."""
        self.kill()
        if self._limits is not None:
            self._breach = self._breach or self._limits.breached()
            self._limits.remove()
            self._limits = None
        self._remove_own_agent()
        self._close_fds()

    def _remove_own_agent(self) -> None:
        if self._own_agent is not None:
            self._own_agent.remove()
            self._own_agent = None

    def limit_breached(self) -> str | None:
        """``"memory"`` or ``"pids"`` if the sandbox hit that limit, else ``None``.

        Meaningful once the host has died; it stays answered after ``cleanup``.
        """
        if self._breach is None and self._limits is not None:
            self._breach = self._limits.breached()
        return self._breach

    @property
    def enforcement(self) -> dict[str, str]:
        """What enforces each limit here, for the agent's log: e.g.
        ``{"memory": "cgroup v1", "pids": "cgroup v1", "nofile": "rlimit", …}``, with the
        agent group's (``agent memory``, ``cpu``) and the host user."""
        base = dict(self._limits.enforcement) if self._limits else {}
        agent = self._agent or self._own_agent
        if agent is not None:
            base["agent memory"] = agent.enforcement.get("memory", "none")
            base["cpu"] = agent.enforcement.get("cpu", "none")
        return {**base, "nofile": "rlimit", "fsize": "rlimit",
                "scratch": f"tmpfs size={self.policy.scratch_size_mb}M each, emptied per job",
                "user": f"host {self.user}" if self.user else f"host uid {os.geteuid()}"}

    def _close_fds(self) -> None:
        if self._fds is not None:
            for fd in self._fds.all():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds = None

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()
