"""`sparecycles agent install-service`: run the agent under systemd, as a non-root user.

Two kinds of unit, both from :func:`render_unit` (infra/systemd/sparecycles-agent.service
is its system unit, checked equal by a test):

- **user** (the default for an ordinary user): ``~/.config/systemd/user/`` — runs as that
  user while they are logged in, or always after ``loginctl enable-linger USER``;
- **system** (``--system``, as root): ``/etc/systemd/system/`` with ``User=`` an existing
  non-root account (default ``sparecycles-agent``); root is refused.

Either way: logs go to the journal (``journalctl [--user] -u sparecycles-agent``);
``KillMode=mixed`` sends the stop signal to the agent alone, so the first SIGTERM drains
(running jobs finish; the plugin hosts are not signalled under them) and systemd kills
what is left only after ``TimeoutStopSec``. Installing again over a running unit — what an
upgrade does after ``pip install -U`` — writes the new unit and restarts it the same way:
the old agent drains first, then the new code starts.
"""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

UNIT_NAME = "sparecycles-agent.service"
DRAIN_TIMEOUT_S = 900


@dataclass(frozen=True)
class UnitSpec:
    mode: str                 # "user" | "system"
    exec_path: str            # the `sparecycles` console script
    home: str                 # SPARECYCLES_AGENT_HOME
    user: str = ""            # system units: the account it runs as
    group: str = ""
    extra_args: tuple[str, ...] = ()   # e.g. ("--idle-only",)
    drain_timeout_s: int = DRAIN_TIMEOUT_S


def render_unit(spec: UnitSpec) -> str:
    if spec.mode not in ("user", "system"):
        raise ConfigError(f"unit mode is {spec.mode!r}; give user or system")
    run = " ".join([spec.exec_path, "agent", "run", *map(_quote, spec.extra_args)])
    lines = [
        "# Written by `sparecycles agent install-service`; run it again to change it.",
        "[Unit]",
        "Description=Sparecycles provider agent",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
    ]
    if spec.mode == "system":
        lines += [
            "# Its own unprivileged user, never root (infra/systemd/sparecycles.sysusers.conf",
            "# creates it); the GPUs' device nodes through the video and render groups.",
            f"User={spec.user}", f"Group={spec.group or spec.user}",
            "SupplementaryGroups=video render",
        ]
    lines += [
        f"Environment=SPARECYCLES_AGENT_HOME={spec.home}",
        "Environment=PYTHONUNBUFFERED=1",
        f"ExecStart={run}",
        "# The plugin hosts' memory and pids limits go in a cgroup subtree of the unit's own.",
        "Delegate=yes",
        "# bubblewrap needs no privilege of its own (user namespaces): nothing may gain any.",
        "NoNewPrivileges=yes",
    ]
    if spec.mode == "system":
        lines += ["ProtectSystem=full", "PrivateTmp=yes"]
    lines += [
        "# The first SIGTERM drains: running jobs finish, no new ones come. Only the agent",
        "# gets it (KillMode=mixed), so its plugin hosts keep running the jobs; whatever is",
        "# left after the timeout is killed.",
        "KillSignal=SIGTERM",
        "KillMode=mixed",
        f"TimeoutStopSec={spec.drain_timeout_s}",
        "Restart=on-failure",
        "RestartSec=10",
        "StandardOutput=journal",
        "StandardError=journal",
        "SyslogIdentifier=sparecycles-agent",
        "",
        "[Install]",
        f"WantedBy={'multi-user.target' if spec.mode == 'system' else 'default.target'}",
        "",
    ]
    return "\n".join(lines)


def _quote(arg: str) -> str:
    if not arg or any(c in arg for c in ' \t"\'\\$%;'):
        return '"' + arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"'
    return arg


def default_exec_path() -> str:
    """The `sparecycles` script of the environment running this command."""
    beside = Path(sys.executable).parent / "sparecycles"
    found = str(beside) if beside.exists() else shutil.which("sparecycles")
    if not found:
        raise ConfigError("cannot find the `sparecycles` command; pass --exec PATH")
    return os.path.abspath(found)


def unit_dir(mode: str) -> Path:
    if mode == "system":
        return Path("/etc/systemd/system")
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "systemd" / "user"


def plan(*, mode: str | None, run_as: str | None, home: Path, exec_path: str | None,
         extra_args: tuple[str, ...] = (), euid: int | None = None) -> UnitSpec:
    """The unit to install, checked: a system unit needs root to install and an existing
    non-root account to run as; the agent's home must exist (run `agent init` first)."""
    euid = os.geteuid() if euid is None else euid
    mode = mode or ("system" if euid == 0 else "user")
    home = Path(home).expanduser().resolve()
    if not (home / "agent.toml").exists():
        raise ConfigError(f"no agent config at {home / 'agent.toml'}: run `sparecycles agent "
                          "init --broker HOST:PORT --api-key KEY` first (with --home for "
                          "another folder)")
    user = group = ""
    if mode == "system":
        if euid != 0:
            raise ConfigError("a system unit is installed by root: run with sudo, or install "
                              "a user unit (without --system)")
        user = run_as or "sparecycles-agent"
        if user in ("root", "0"):
            raise ConfigError("the agent does not run as root under systemd: give --run-as "
                              "an ordinary account (e.g. `useradd --system --create-home "
                              "sparecycles`)")
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise ConfigError(f"there is no user {user!r}: create it (`useradd --system "
                              f"--create-home {user}`) or give --run-as another") from None
        if entry.pw_uid == 0:
            raise ConfigError(f"user {user!r} has uid 0; give an ordinary account")
        import grp

        group = grp.getgrgid(entry.pw_gid).gr_name
        _check_readable(home, entry.pw_uid, entry.pw_gid, user)
    elif run_as:
        raise ConfigError("--run-as is for system units (--system, as root); a user unit runs "
                          "as the user who installs it")
    elif euid == 0:
        raise ConfigError("as root, install a system unit (--system --run-as USER): a user "
                          "unit would run the agent as root")
    return UnitSpec(mode=mode, exec_path=exec_path or default_exec_path(), home=str(home),
                    user=user, group=group, extra_args=tuple(extra_args))


def _check_readable(home: Path, uid: int, gid: int, user: str) -> None:
    st = home.stat()
    if st.st_uid != uid:
        raise ConfigError(f"{home} belongs to uid {st.st_uid}, not {user}: the agent keeps its "
                          f"key and config there. Give it to {user} (`chown -R {user}: {home}`)"
                          f" or run `agent init --home` as {user}")


def install(spec: UnitSpec, *, directory: Path | None = None, start: bool = True,
            systemctl: str = "systemctl") -> tuple[Path, list[str]]:
    """Write the unit; with ``start``, reload systemd, enable it and (re)start it — a
    running agent drains first. Returns the unit's path and what was done."""
    directory = directory or unit_dir(spec.mode)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / UNIT_NAME
    text = render_unit(spec)
    changed = not path.exists() or path.read_text() != text
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    done = [f"wrote {path}" if changed else f"{path} unchanged"]
    if not start:
        return path, done
    scope = ["--user"] if spec.mode == "user" else []
    for args in (["daemon-reload"], ["enable", UNIT_NAME]):
        _systemctl(systemctl, scope + args)
    active = subprocess.run([systemctl, *scope, "is-active", "--quiet", UNIT_NAME],
                            capture_output=True).returncode == 0
    if active:
        _systemctl(systemctl, scope + ["restart", UNIT_NAME])
        done.append("restarted it: the running agent drained its jobs first")
    else:
        _systemctl(systemctl, scope + ["start", UNIT_NAME])
        done.append("started it")
    return path, done


def _systemctl(systemctl: str, args: list[str]) -> None:
    try:
        # A restart waits for the drain: up to the unit's stop timeout.
        out = subprocess.run([systemctl, *args], capture_output=True, text=True,
                             timeout=DRAIN_TIMEOUT_S + 60)
    except FileNotFoundError:
        raise ConfigError(f"{systemctl} not found: this machine does not run systemd; start "
                          "the agent another way, or pass --no-start to only write the "
                          "unit") from None
    if out.returncode != 0:
        hint = ("; a user unit needs a user session with systemd (log in, or "
                "`loginctl enable-linger $USER`)" if "--user" in args else "")
        raise ConfigError(f"`systemctl {' '.join(args)}` failed: "
                          f"{out.stderr.strip() or out.stdout.strip()}{hint}")
