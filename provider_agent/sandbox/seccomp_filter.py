"""The seccomp filter installed in every plugin host.

The filter is built with ``pyseccomp`` (which loads the machine's libseccomp) in the agent,
exported as raw BPF into a memfd, and handed to bubblewrap with ``--seccomp FD``.  Doing it
that way rather than loading it inside the host has three advantages: bwrap installs it
after its own mount/namespace setup (which needs the very syscalls we refuse) and right
before it executes the host, so *all* host code — including the first line of Python and
anything a plugin spawns — runs under it; the host needs no libseccomp binding of its own;
and a plugin cannot "forget" to load it.

Refused syscalls return ``EPERM`` rather than killing the process, so libraries that probe
(``ptrace`` for debuggers, ``perf_event_open`` for profilers, io_uring) fail cleanly.
Syscalls of a foreign architecture (32-bit ``int 0x80``, x32) are killed by libseccomp's
default bad-architecture action, which closes the ``socketcall`` back door.
"""
from __future__ import annotations

import errno
import os
import socket

#: Syscalls refused outright with EPERM.  Names unknown to this kernel/arch are skipped.
DENIED_SYSCALLS: tuple[str, ...] = (
    # debugging other processes / reading their memory
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # mounting, including the new mount API and pivots
    "mount", "umount2", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
    "open_tree", "mount_setattr", "pivot_root", "chroot",
    # new namespaces (a user namespace would give back capabilities)
    "unshare", "setns",
    # kernel attack surface with no use in inference
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "open_by_handle_at", "name_to_handle_at", "swapon", "swapoff", "reboot",
    "acct", "quotactl", "lookup_dcookie", "syslog", "iopl", "ioperm",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    # POSIX message queues: a named store outside the writable places the host empties
    # after each job (and no inference library uses them)
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
)

#: clone() flags that create namespaces; a clone carrying any of them is refused.
_CLONE_NS_FLAGS = (0x10000000,  # CLONE_NEWUSER
                   0x00020000,  # CLONE_NEWNS
                   0x40000000,  # CLONE_NEWNET
                   0x20000000,  # CLONE_NEWPID
                   0x08000000,  # CLONE_NEWIPC
                   0x04000000,  # CLONE_NEWUTS
                   0x02000000)  # CLONE_NEWCGROUP


def build_filter():
    """Return a ``pyseccomp.SyscallFilter`` implementing the policy (default: allow)."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as exc:  # OSError: pyseccomp present, libseccomp not
        from .errors import SandboxUnavailable
        raise SandboxUnavailable(
            f"seccomp support is missing ({exc}): pip install pyseccomp and "
            "apt-get install libseccomp2, or run the agent with --no-sandbox") from exc

    eperm = sc.ERRNO(errno.EPERM)
    flt = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            flt.add_rule(eperm, name)
        except (ValueError, OSError, RuntimeError):
            pass  # not a syscall on this architecture (e.g. iopl on aarch64)

    # Only AF_UNIX sockets: Python's multiprocessing and torch need socketpair(AF_UNIX).
    # With the network namespace empty this is belt and braces, but it also refuses
    # AF_NETLINK, AF_PACKET, AF_VSOCK, AF_ALG… which have had kernel bugs of their own.
    for call in ("socket", "socketpair"):
        flt.add_rule(eperm, call, sc.Arg(0, sc.NE, socket.AF_UNIX))

    for flag in _CLONE_NS_FLAGS:
        flt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    # clone3 passes its flags in memory, out of seccomp's reach: ENOSYS makes glibc fall
    # back to clone(), whose flags the rule above can see (the approach Docker takes).
    try:
        flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    except (ValueError, OSError, RuntimeError):
        pass
    return flt


def bpf_memfd() -> int:
    """Export the filter as BPF into a fresh memfd and return the fd, positioned at 0.

    The caller passes it to bwrap (``--seccomp FD`` with ``pass_fds``) and closes it after
    the process has started.
    """
    fd = os.memfd_create("sparecycles-seccomp", 0)
    try:
        with os.fdopen(os.dup(fd), "wb") as out:
            build_filter().export_bpf(out)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
