"""The plugin API: what a model plugin implements and what the plugin host gives it.

A plugin is a folder with ``plugin.toml`` (see ``sdk.protocol.manifest``) and a module
holding a :class:`Plugin` subclass. The host process calls ``setup()`` once (load weights:
seconds) and ``run()`` once per job (must not reload anything). A plugin imports only this
module and its ML libraries; it reads no environment variables and opens no sockets.
"""
from __future__ import annotations

import base64
import hashlib
import math
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


#: Where in its schedule an image run records its latents for verification (DESIGN §6,
#: issue #20): after step ``ceil(f * total)`` for each fraction ``f``.
TRACE_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
#: Each recorded latent is average-pooled to at most this many latent pixels a side.
TRACE_SIDE = 8


def trace_steps(total: int) -> list[int]:
    """The steps (1-based) after which a run of ``total`` denoising steps records its
    latents for the latent trace: ``ceil(f * total)`` for each of ``TRACE_FRACTIONS``, the
    last step always among them."""
    return sorted({max(1, min(total, math.ceil(f * total - 1e-9))) for f in TRACE_FRACTIONS})


def trace_point(tensor: Any) -> str:
    """One image's latents (``latents[i]``: C × H × W, any device and dtype) as the latent
    trace records them: float32, average-pooled to at most ``TRACE_SIDE`` a side, rounded
    to float16, C order, base64. Two honest runs of one job give near-equal points however
    their numeric paths differ; a run of fewer steps or at another size does not (its
    trajectory is another), which the final image often hides."""
    import numpy as np
    import torch

    x = tensor.detach().to("cpu", torch.float32)
    if x.ndim == 3:
        h, w = x.shape[-2:]
        x = torch.nn.functional.adaptive_avg_pool2d(
            x.unsqueeze(0), (min(h, TRACE_SIDE), min(w, TRACE_SIDE)))[0]
    arr = np.ascontiguousarray(x.numpy().astype(np.float16))
    return base64.b64encode(arr.tobytes()).decode()


def latent_trace(points: list[str], steps: list[int], total: int, shape: tuple) -> dict:
    """The ``latent_trace`` meta of one image: its points (``trace_point``), the steps they
    were recorded after, the run's step count and the points' shape (C, h, w)."""
    return {"v": 1, "total": int(total), "steps": [int(s) for s in steps],
            "shape": [int(d) for d in shape], "points": list(points)}


def latent_digest(tensor: Any) -> str:
    """The sha256 hex that verification compares between two runs of an image job on the
    same reproducibility class (DESIGN §6): over one image's final denoised latents (before
    the VAE decode), as float32, in C order, prefixed with the numpy dtype and shape::

        arr = tensor.detach().cpu().float().numpy()   # contiguous
        sha256(f"{arr.dtype.str}{arr.shape}".encode() + arr.tobytes())

    e.g. ``"<f4(4, 8, 8)"`` then the bytes. ``tensor``: a torch tensor of one image's
    latents (``latents[i]``), on any device and in any dtype."""
    import numpy as np  # the ML plugins' dependency, not the plugin API's

    arr = np.ascontiguousarray(tensor.detach().cpu().float().numpy())
    h = hashlib.sha256(f"{arr.dtype.str}{arr.shape}".encode())
    h.update(arr.tobytes())
    return h.hexdigest()


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

    def preview(self, step: int, data: bytes, media_type: str = "image/webp") -> None:
        """A small picture of the output so far (a thumbnail of at most a few KiB) that the
        client sees with the progress of ``step``; call it a few times per job, not every
        step. Optional: a plugin that sends none is fine."""

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

    def input_defaults(self) -> dict[str, Any]:
        """After ``setup()``: the defaults the loaded weights give the inputs the manifest
        declares with ``default_from = "weights"`` (e.g. an image model's own size). The
        host checks them against the schema, fills them into jobs that leave those inputs
        out, and the agent tells the broker, which fills them in before it prices a job.
        Read from what ``setup()`` loaded: no extra work. Default: none."""
        return {}

    def teardown(self) -> None:
        """Free resources before the host exits."""


DTYPES = ("float32", "bfloat16", "float16")


def run_dtype(device_type: str, default_gpu: str = "float16"):
    """The torch dtype a model plugin runs in: ``SPARECYCLES_DTYPE`` when the provider set
    it (float32, bfloat16 or float16), else ``default_gpu`` on a GPU and float32 on the CPU.
    The dtype is part of the receipt's reproducibility class."""
    import os

    import torch

    name = os.environ.get("SPARECYCLES_DTYPE", "").strip()
    if name and name not in DTYPES:
        raise PluginError(f"SPARECYCLES_DTYPE is {name!r}; use one of {', '.join(DTYPES)}",
                          retryable=False)
    if not name:
        name = default_gpu if device_type == "cuda" else "float32"
    return getattr(torch, name)
