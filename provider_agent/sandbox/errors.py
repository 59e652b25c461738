"""Errors of the plugin-host sandbox: a family under the agent's ``AgentError``."""
from __future__ import annotations

from provider_agent.errors import AgentError


class SandboxError(AgentError):
    """Something about the sandbox failed; the message says what to do next."""


class SandboxUnavailable(SandboxError):
    """bubblewrap (or seccomp support) is missing or does not work on this machine."""


class SandboxPolicyError(SandboxError, ValueError):
    """A ``SandboxPolicy`` value cannot be honoured (a missing path, a bad limit)."""


class SandboxLimitError(SandboxError):
    """A control-group limit could not be set up."""
