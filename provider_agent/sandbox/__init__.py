"""Sandbox for plugin hosts: bubblewrap namespaces, a seccomp filter, cgroup limits.

The agent builds a ``SandboxPolicy`` (what the host may read, its limits, its GPUs and
environment) and starts the host with ``Sandbox(policy, name).popen(argv, …)``.  See
DESIGN.md §8.  ``Sandbox.available()`` says whether this machine can sandbox at all and,
if not, what to install.
"""
from .bwrap import gpu_device_args
from .errors import (SandboxError, SandboxLimitError, SandboxPolicyError,
                     SandboxUnavailable)
from .launcher import Sandbox
from .policy import SandboxPolicy

__all__ = ["Sandbox", "SandboxPolicy", "gpu_device_args", "SandboxError",
           "SandboxUnavailable", "SandboxPolicyError", "SandboxLimitError"]
