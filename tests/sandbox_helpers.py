"""Running agent-side code as an ordinary (unprivileged) user, for the sandbox tests: the
issue asks each sandbox promise to hold from a sandbox started by root and by an ordinary
user, where the machine allows the latter."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]


def run_as_ordinary_user(code: str, reachable: list[Path] = (),
                         timeout_s: float = 180) -> subprocess.CompletedProcess:
    """Run ``code`` (agent-side Python) as an ordinary host user, which then starts
    sandboxes itself the way an agent that is not root does. As root, the helper that
    starts plugin hosts (provider_agent/sandbox/drop_to_user.py) makes the interpreter, the
    checkout and ``reachable`` paths reachable to that user (they may lie below /root or
    pytest's 0700 temporary folder) and drops to it; otherwise this process already is an
    ordinary user and runs ``code`` itself."""
    from provider_agent.sandbox import SandboxPolicy, SandboxUser
    from provider_agent.sandbox.bwrap import helper_command
    from provider_agent.sandbox.hostuser import staging_plan

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent"}
    if os.geteuid() != 0:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout_s, env=env)
    user = SandboxUser.resolve()
    sources = [str(p) for p in (*SandboxPolicy.current_python_prefixes(), PROJECT,
                                *reachable)]
    spec = {"uid": user.uid, "gid": user.gid, "groups": list(user.groups),
            "plan": [[op.kind, op.path] for op in staging_plan(sources, user)],
            "argv": [sys.executable, "-c", code]}
    return subprocess.run(helper_command(spec), capture_output=True, text=True,
                          timeout=timeout_s, env=env, cwd="/")
