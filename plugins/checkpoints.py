"""Checkpoints of the built-in plugins: how a half-done job is written down and read back.

A checkpoint is what a provider hands the broker every k steps of a long job so that,
when the provider disappears, another one continues from there instead of from step 0
(DESIGN §2). The bytes are opaque to the broker and the agent; only the plugin that wrote
them reads them, and only ``plugins`` code from this module does.

Format: ``torch.save`` of a dict holding only tensors, lists, dicts, strings, numbers,
booleans and None, read back with ``torch.load(weights_only=True)``: a checkpoint comes
from another provider, so it must never be able to run code when loaded (a plain pickle
could). numpy arrays are stored as tensors under ``{"__ndarray__": tensor}``.

Diffusion (``kind = "diffusion"``)::

    {"format": "sparecycles.checkpoint/1", "kind": "diffusion", "step": k, "total": n,
     "fingerprint": sha256 of the job inputs, "scheduler": class name,
     "dtype": "torch.float32", "device": "cpu",
     "latents": tensor, "scheduler_state": {attribute: value, ...},  # all but the config
     "rng": [uint8 tensor per image generator]}

Llama (``kind = "tokens"``)::

    {"format": ..., "kind": "tokens", "step": k, "total": max_new_tokens, "fingerprint": ...,
     "token_ids": [...], "logprobs": [...], "rng": uint8 tensor}
"""
from __future__ import annotations

import hashlib
import io
import json
from typing import Any

import numpy as np
import torch

from plugins.api import PluginError

FORMAT = "sparecycles.checkpoint/1"
MAX_CHECKPOINT_BYTES = 256 * 1024 * 1024


class BadCheckpoint(PluginError):
    """A checkpoint that cannot be resumed from (corrupt, another job's, another plugin's).
    Retryable: the broker can run the job from the start elsewhere."""

    code = "bad_checkpoint"
    retryable = True


def fingerprint(inputs: dict[str, Any]) -> str:
    """What ties a checkpoint to one job's inputs (the resumed job must be the same job)."""
    body = json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(body.encode()).hexdigest()


def _plain(value: Any) -> Any:
    """``value`` with tensors on the CPU and numpy arrays wrapped (weights_only-loadable)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").clone()
    if isinstance(value, np.ndarray):
        return {"__ndarray__": torch.from_numpy(np.ascontiguousarray(value).copy())}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot checkpoint a {type(value).__name__}")


def _restore(value: Any, device: torch.device | None) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device) if device is not None else value
    if isinstance(value, dict):
        if set(value) == {"__ndarray__"}:
            return value["__ndarray__"].numpy()
        return {k: _restore(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore(v, device) for v in value]
    return value


def dumps(doc: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(_plain({"format": FORMAT, **doc}), buf)
    return buf.getvalue()


def loads(data: bytes, *, kind: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint in ``data``; :class:`BadCheckpoint` unless it is a ``kind``
    checkpoint of a job with exactly these ``inputs``."""
    if len(data) > MAX_CHECKPOINT_BYTES:
        raise BadCheckpoint(f"checkpoint is {len(data)} bytes; at most "
                            f"{MAX_CHECKPOINT_BYTES} are read")
    try:
        doc = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any corruption is the same refusal
        raise BadCheckpoint(f"checkpoint could not be read: {type(exc).__name__}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BadCheckpoint(f"checkpoint is not a {FORMAT} checkpoint")
    if doc.get("kind") != kind:
        raise BadCheckpoint(f"checkpoint is a {doc.get('kind')!r} checkpoint; "
                            f"this plugin resumes {kind!r} checkpoints")
    if doc.get("fingerprint") != fingerprint(inputs):
        raise BadCheckpoint("checkpoint belongs to a job with other inputs")
    return doc


def restore(value: Any, device: torch.device | None = None) -> Any:
    """Unwrap numpy arrays and move tensors to ``device`` (None: leave them on the CPU)."""
    return _restore(value, device)


def scheduler_state(scheduler) -> dict[str, Any]:
    """Every attribute of a diffusers scheduler except its config: the timesteps and sigmas,
    the step and begin indices, and multistep solvers' history (DPM-Solver++'s
    ``model_outputs`` and ``lower_order_nums``, ...)."""
    # Callables are left out: while resuming, ``step`` is wrapped by an instance attribute.
    return {k: _plain(v) for k, v in vars(scheduler).items()
            if k != "_internal_dict" and not callable(v)}


def load_scheduler_state(scheduler, state: dict[str, Any], device: torch.device) -> None:
    for key, value in state.items():
        current = getattr(scheduler, key, None)
        restored = _restore(value, None)
        if isinstance(restored, torch.Tensor) and isinstance(current, torch.Tensor):
            restored = restored.to(current.device)
        elif isinstance(restored, list):
            restored = [v.to(device) if isinstance(v, torch.Tensor) else v for v in restored]
        setattr(scheduler, key, restored)
