"""Errors of the provider agent."""


class AgentError(Exception):
    """Root of agent errors."""


class ConfigError(AgentError):
    """The agent's configuration is missing or wrong; the message says how to fix it."""


class HostError(AgentError):
    """A plugin host could not run a job. ``code`` is reported to the broker."""

    def __init__(self, code: str, message: str, *, retryable: bool = True):
        super().__init__(message)
        self.code = code
        self.retryable = retryable
