"""The unprivileged host user a plugin host runs as when the agent is root.

bubblewrap's ``--uid`` only names the uid *inside* the sandbox's user namespace: started by
root, that uid is host uid 0 outside, and a fresh ``/proc`` lets it write the host's
``/proc/sys`` (``kernel.core_pattern`` runs a command as host root at the next crash). So
an agent running as root never runs bwrap as root: it starts bwrap as the *sandbox user*
(``sparecycles-sandbox`` when that user exists, else ``nobody``; ``sandbox_user`` in
agent.toml picks another), and bwrap builds an unprivileged user namespace owned by that
user. Every process of the sandbox, bwrap's own included, is then that uid on the host.

bwrap looks up the paths it binds as the user it runs as, and root's files are often out
of that user's reach (``/root`` is 0700, and the interpreter, a venv or the weights may
live below it). ``staging_plan`` works out how to make exactly the bound paths reachable:
in a private mount namespace (``drop_to_user.py``, run as root before bwrap) each
directory the sandbox user cannot pass through is covered by an empty root-owned tmpfs
(0755) and the bound paths below it are bind-mounted back at their own place. Nothing is
chmod-ed on the host, nothing is mounted outside that namespace, and what is not bound
stays out of reach.
"""
from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from .errors import SandboxPolicyError

#: The user created for plugin hosts (see README: useradd --system sparecycles-sandbox).
DEDICATED_USER = "sparecycles-sandbox"
FALLBACK_USER = "nobody"
OVERFLOW_ID = 65534


@dataclass(frozen=True)
class SandboxUser:
    """A host uid/gid (and supplementary groups) that is not root."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        if self.uid == 0 or self.gid == 0 or 0 in self.groups:
            raise SandboxPolicyError(
                f"the sandbox user must not be root or in group root (uid {self.uid}, gid "
                f"{self.gid}, groups {list(self.groups)}): pick an unprivileged user for "
                "sandbox_user in agent.toml")

    def __str__(self) -> str:
        return f"{self.name or 'uid'} ({self.uid}:{self.gid})"

    @classmethod
    def resolve(cls, spec: str = "") -> "SandboxUser":
        """``spec`` is a user name, ``UID`` or ``UID:GID``; empty: the dedicated
        ``sparecycles-sandbox`` user if it exists, else ``nobody`` (65534)."""
        spec = (spec or "").strip()
        if not spec:
            for name in (DEDICATED_USER, FALLBACK_USER):
                try:
                    return cls._named(pwd.getpwnam(name))
                except KeyError:
                    continue
            return cls(OVERFLOW_ID, OVERFLOW_ID, (OVERFLOW_ID,), "nobody")
        uid_text, _, gid_text = spec.partition(":")
        if uid_text.isdigit() and (not gid_text or gid_text.isdigit()):
            uid = int(uid_text)
            try:
                entry = pwd.getpwuid(uid)
            except KeyError:
                entry = None
            gid = int(gid_text) if gid_text else (entry.pw_gid if entry else uid)
            return cls(uid, gid, (gid,), entry.pw_name if entry else "")
        if gid_text:
            raise SandboxPolicyError(
                f"sandbox_user {spec!r}: give a user name, a uid or uid:gid (numbers)")
        try:
            return cls._named(pwd.getpwnam(spec))
        except KeyError:
            raise SandboxPolicyError(
                f"sandbox_user {spec!r} is not a user on this machine: create it (useradd "
                f"--system --no-create-home --shell /usr/sbin/nologin {spec}) or give a "
                "numeric uid") from None

    @classmethod
    def _named(cls, entry: pwd.struct_passwd) -> "SandboxUser":
        groups = tuple(sorted(set(os.getgrouplist(entry.pw_name, entry.pw_gid))))
        return cls(entry.pw_uid, entry.pw_gid, groups, entry.pw_name)

    # ---- what this user may do with a file, by its mode bits (as the kernel decides) ----
    def _bits(self, st: os.stat_result) -> int:
        if st.st_uid == self.uid:
            return (st.st_mode >> 6) & 7
        if st.st_gid == self.gid or st.st_gid in self.groups:
            return (st.st_mode >> 3) & 7
        return st.st_mode & 7

    def may(self, path: Path | str, want: int) -> bool:
        """Whether this user has every permission bit of ``want`` (4 r, 2 w, 1 x) on
        ``path`` (False when it cannot be stat-ed)."""
        try:
            st = os.stat(path)
        except OSError:
            return False
        return self._bits(st) & want == want


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def describe(path: Path | str) -> str:
    """``/root (0700, root:root)``, for error messages."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path} ({exc.strerror})"
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    return f"{path} ({stat.S_IMODE(st.st_mode):04o}, {owner}:{_group_name(st.st_gid)})"


#: How many entries of the trees given to ``unusable_sources(deep=…)`` are looked at, at
#: most (weights folders hold tens of files; this only bounds a pathological tree).
DEEP_CHECK_ENTRIES = 50_000


def unusable_sources(sources: list[str], user: SandboxUser, devices: list[str] = (),
                     deep: list[str] = (), skip: list[str] = ()) -> list[str]:
    """The bound paths ``user`` could not use once bound: a directory it cannot list and
    enter, a file it cannot read, a device node (``devices``) it cannot read and write.
    The trees of ``deep`` (a plugin, its weights) are looked at all the way down, but for
    ``skip`` (what the sandbox hides anyway)."""
    bad = []
    skip = set(skip)

    def check(path: str, st: os.stat_result) -> None:
        want = 6 if path in devices else 5 if stat.S_ISDIR(st.st_mode) else 4
        if user._bits(st) & want != want:
            bad.append(describe(path))

    for src in sources:
        try:
            check(src, os.stat(src))
        except OSError:
            continue  # bwrap reports a missing source itself
    budget = DEEP_CHECK_ENTRIES
    for top in deep:
        for folder, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if os.path.join(folder, d) not in skip]
            for name in [*dirs, *files]:
                budget -= 1
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path, follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISLNK(st.st_mode):
                    check(path, st)
            if len(bad) >= 5 or budget <= 0:
                return bad
    return bad


@dataclass(frozen=True)
class StageOp:
    """``cover``: mount an empty root-owned tmpfs (0755) on ``path``; ``expose``: bind
    the real ``path`` (opened before any cover) back at ``path``."""

    kind: str
    path: str


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def staging_plan(sources: list[str], user: SandboxUser) -> list[StageOp]:
    """What to mount, in order, so that ``user`` can reach every path of ``sources``
    (absolute, symlinks resolved) by its own name. Empty when it already can.

    The plan is simulated on the way: below a cover only what was exposed (and the
    directories leading to it, which the cover's tmpfs holds) exists; elsewhere the real
    directory is checked."""
    mounts: list[StageOp] = []   # covers and exposes made so far
    plan: list[StageOp] = []

    def deepest(path: str) -> StageOp | None:
        best = None
        for op in mounts:
            if _within(path, op.path) and (best is None or len(op.path) > len(best.path)):
                best = op
        return best

    for src in sorted(set(sources), key=lambda p: (p.count("/"), p)):
        if not os.path.lexists(src):
            continue                                 # bwrap says what is missing
        parts = Path(src).parts
        for depth in range(2, len(parts)):           # the ancestors below "/"
            ancestor = str(Path(*parts[:depth]))
            top = deepest(ancestor)
            if top is not None and top.kind == "cover":
                continue                             # the cover's tmpfs, or a folder in it
            if not user.may(ancestor, 1):
                op = StageOp("cover", ancestor)
                mounts.append(op)
                plan.append(op)
        top = deepest(src)
        if top is not None and top.kind == "cover":
            op = StageOp("expose", src)
            mounts.append(op)
            plan.append(op)
    return plan
