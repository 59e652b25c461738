"""The plugin API: what a model plugin implements and what the plugin host gives it.

A plugin is a folder with ``plugin.toml`` (see ``sdk.protocol.manifest``) and a module
holding a :class:`Plugin` subclass. The host process calls ``setup()`` once (load weights:
seconds) and ``run()`` once per job (must not reload anything). A plugin imports only this
module and its ML libraries; it reads no environment variables and opens no sockets.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sdk.protocol.manifest import Manifest, ManifestError, load_manifest  # noqa: F401
from sdk.protocol.schema import InputError  # noqa: F401


class PluginError(Exception):
    """A job failed inside the plugin. ``code`` is stable; ``retryable`` says whether
    another provider could succeed (False for bad inputs)."""

    code = "plugin_error"
    retryable = True

    def __init__(self, message: str, *, code: str | None = None, retryable: bool | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        if retryable is not None:
            self.retryable = retryable


class Cancelled(PluginError):
    """The job was cancelled; raised from ``ctx.check_cancelled()`` between steps."""

    code = "cancelled"
    retryable = False


class BadInput(PluginError):
    """Inputs the schema allowed but the model cannot take (e.g. a prompt too long)."""

    code = "bad_input"
    retryable = False


@dataclass
class Output:
    """One output of a job: the bytes as they go to the blob store."""

    data: bytes
    media_type: str  # image/png, text/plain, application/json
    meta: dict[str, Any] = field(default_factory=dict)


class RunContext(Protocol):
    """What ``run()`` may call. The host implements it."""

    job_id: str
    scratch_dir: Path
    #: Write a checkpoint every this many steps (0: never). The agent asks for checkpoints
    #: only for jobs long enough to be worth moving half-done (DESIGN §2).
    checkpoint_every: int
    #: The bytes of a checkpoint this plugin wrote on an earlier attempt of the same job
    #: (on another provider): continue from it rather than from the start. None: start.
    resume_from: bytes | None

    def progress(self, step: int, total: int, message: str = "") -> None:
        """Report that ``step`` of ``total`` is done (cheap; call every step)."""

    def stream(self, text: str, token_ids: list[int] | None = None) -> None:
        """Send a piece of text output (a token) to the client as soon as it is made."""

    def checkpoint(self, step: int, data: bytes) -> None:
        """Hand over the state after ``step`` steps as opaque bytes; if the provider goes
        away, another one gets them back as ``resume_from``. Only the latest counts."""

    def cancelled(self) -> bool:
        """True once the job has been cancelled."""

    def check_cancelled(self) -> None:
        """Raise :class:`Cancelled` if the job has been cancelled."""


class Plugin:
    """Base class of every model plugin (``setup()`` once, ``run()`` per job)."""

    manifest: Manifest

    def setup(self, weights_dir: Path | None, device: str) -> None:
        """Load the model from ``weights_dir`` onto ``device`` ("cpu", "cuda", "cuda:1")."""

    def run(self, inputs: dict[str, Any], ctx: RunContext) -> list[Output]:
        """Run one job. ``inputs`` are already validated against the manifest's schema,
        with defaults filled in."""
        raise NotImplementedError

    def teardown(self) -> None:
        """Free resources before the host exits."""
