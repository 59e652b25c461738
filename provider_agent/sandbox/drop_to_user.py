"""Run as root just before bubblewrap: stage what it binds, become the sandbox user, exec.

``python -I -S drop_to_user.py SPEC`` where SPEC is JSON: ``uid``, ``gid``, ``groups``,
``plan`` (``[kind, path]`` pairs from ``hostuser.staging_plan``), ``rlimits`` (``[resource,
value]`` pairs, set on itself and so inherited by everything bwrap starts) and ``argv``
(the bwrap command). In a new, private mount namespace (nothing propagates back to the host) it
opens every path to expose, covers each directory the sandbox user cannot pass through
with an empty root-owned tmpfs (0755), binds the exposed paths back at their own place,
then sets the groups, gid and uid (root's capabilities go with the uid) and executes
bwrap, which then runs unprivileged and builds a user namespace of that user.

With ``prlimit`` in SPEC instead of ``argv`` it sets those rlimits on those pids, as the
sandbox user: root may lack CAP_SYS_RESOURCE (containers often do), without which only a
process of the same uid and gid may change another's limits.

Standard library only, and no import of the project: it runs with ``-I -S`` (isolated,
no site) before anything else, so nothing on the environment or sys.path changes it.
"""
import ctypes
import json
import os
import resource
import stat
import sys

CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000


def _die(what: str, err: int) -> None:
    sys.stderr.write(f"sparecycles sandbox: {what}: {os.strerror(err)}\n")
    sys.stderr.flush()
    os._exit(126)


def main(spec: dict) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                           ctypes.c_ulong, ctypes.c_char_p]

    def mount(source, target, fstype, flags, data=None):
        enc = (lambda v: v.encode() if isinstance(v, str) else v)
        if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
            _die(f"mount {fstype or 'bind'} {source} on {target}", ctypes.get_errno())

    os.umask(0o022)
    plan = [(kind, path) for kind, path in spec.get("plan", ())]
    if plan:
        if libc.unshare(CLONE_NEWNS) != 0:
            _die("unshare(CLONE_NEWNS)", ctypes.get_errno())
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        # Opened before any cover hides them (and in this namespace, so they can be bound).
        fds = {path: os.open(path, os.O_PATH) for kind, path in plan if kind == "expose"}
        for kind, path in plan:
            if kind == "cover":
                mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
                continue
            fd = fds[path]
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.makedirs(path, mode=0o755, exist_ok=True)
            elif not os.path.lexists(path):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
            mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        for fd in fds.values():
            os.close(fd)
    os.chdir("/")
    for res, value in spec.get("rlimits", ()):  # lowering one's own: no privilege needed
        resource.setrlimit(int(res), (int(value), int(value)))
    uid, gid = int(spec["uid"]), int(spec["gid"])
    try:
        os.setgroups([int(g) for g in spec.get("groups", [gid])])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    except OSError as exc:
        _die(f"switching to uid {uid} gid {gid}", exc.errno)
    if os.getuid() == 0 or os.geteuid() == 0:
        _die("still root after setresuid", 1)
    if "prlimit" in spec:
        for pid, limits in spec["prlimit"]:
            for res, value in limits:
                try:
                    resource.prlimit(int(pid), int(res), (int(value), int(value)))
                except ProcessLookupError:
                    break
                except OSError as exc:
                    _die(f"prlimit of pid {pid}", exc.errno)
        os._exit(0)
    argv = spec["argv"]
    try:
        os.execv(argv[0], argv)
    except OSError as exc:
        _die(f"exec {argv[0]}", exc.errno)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
