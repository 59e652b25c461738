"""Sandbox for plugin hosts: bubblewrap namespaces, a seccomp filter, cgroup limits.

The agent builds a ``SandboxPolicy`` (what the host may read, its limits, its GPUs and
environment) and starts the host with ``Sandbox(policy, name, agent_limits=…).popen(argv,
…)``; ``cgroups.make_agent_limits`` makes the group all of an agent's hosts share (memory
budget, CPU cores). As root, sandboxes run as an unprivileged host user (``SandboxUser``,
see ``hostuser``). See DESIGN.md §8. ``Sandbox.available()`` says whether this machine can
sandbox at all and, if not, what to install.
"""
from .bwrap import gpu_device_args
from .errors import (SandboxError, SandboxLimitError, SandboxPolicyError,
                     SandboxUnavailable)
from .hostuser import SandboxUser
from .launcher import Sandbox
from .policy import SandboxPolicy

__all__ = ["Sandbox", "SandboxPolicy", "SandboxUser", "gpu_device_args", "SandboxError",
           "SandboxUnavailable", "SandboxPolicyError", "SandboxLimitError"]
