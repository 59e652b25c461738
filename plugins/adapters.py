"""LoRA adapters for the built-in plugins: the ``adapters`` input, where adapters live on
disk, and an LRU cache of the adapters loaded into a warm base model.

The input (``adapters``, a string; the schema has no lists) names adapters and scales::

    "ink"                   one adapter at scale 1
    "ink:0.8,film:0.5"      several, comma-separated name:scale pairs (spaces allowed)
    '{"ink": 0.8}'          or the same as a JSON object

At most ``MAX_ADAPTERS_PER_JOB`` adapters, scales within ``SCALE_LIMITS``; a scale of 0
gives exactly the base model's output.

Adapters are folders, one per adapter, named by the adapter, looked up in two places
(the first that has the name wins)::

    <weights root>/sd15/                      the base weights (weights_dir of the plugin)
    <weights root>/sd15/adapters/<name>/      1. inside the base weights folder
    <weights root>/adapters/sd15/<name>/      2. beside it, grouped by model family

that is ``<weights_dir>/adapters/<name>/`` and ``<weights_dir>/../adapters/<family>/<name>/``.
A diffusers adapter holds ``pytorch_lora_weights.safetensors`` (or exactly one other
``.safetensors`` file); a peft adapter ``adapter_model.safetensors`` and
``adapter_config.json``. (A sandboxed plugin host sees both places of its own plugin,
and no other plugin's: provider_agent.launch.plugin_ro_paths.)
An adapter folder may declare its
base in ``adapter.json`` (``{"base_model": "sdxl"}``); a declared base other than the
plugin's family is refused before loading, and an undeclared adapter whose tensors do not
fit the model is refused when loading fails. Either way the job fails with ``BadInput``
and the warm model is left as it was.

This module is shared by built-in plugins only (like ``plugins.diffusion``).
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from plugins.api import BadInput, PluginError
from sdk.protocol.adapters import ADAPTER_INPUT_NAME_RE as _NAME
from sdk.protocol.adapters import ADAPTER_SCALE_LIMITS as SCALE_LIMITS
from sdk.protocol.adapters import MAX_ADAPTERS_PER_JOB, check_adapters
DEFAULT_CACHE_SIZE = 8  # adapters kept loaded in the warm model (least recently used go)
DECLARATION = "adapter.json"


@dataclass(frozen=True)
class AdapterRequest:
    name: str
    scale: float


def parse_adapters(text: str | None) -> list[AdapterRequest]:
    """The ``adapters`` input as a list of (name, scale) in name order; empty for "" or None.
    The check is sdk.protocol.package.check_adapters, the one the broker runs at submit;
    here its refusal is the plugin's BadInput.

    Name order, not the order given: the LoRA deltas are summed in list order and float
    sums depend on order, so "ink,film" and "film,ink" must reach the model the same way
    to give the same bytes (newer peft no longer sorts them itself)."""
    try:
        return [AdapterRequest(name, scale) for name, scale in check_adapters(text)]
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def adapter_roots(weights_dir: Path, family: str) -> list[Path]:
    """Where the adapters of ``family`` live for a plugin whose weights are ``weights_dir``,
    in lookup order."""
    weights_dir = Path(weights_dir).resolve()
    return [weights_dir / "adapters", weights_dir.parent / "adapters" / family]


def declared_base(folder: Path) -> str | None:
    """The base model an adapter folder declares in ``adapter.json``, if it does."""
    try:
        data = json.loads((folder / DECLARATION).read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise BadInput(f"adapter folder {folder.name!r} has an unreadable {DECLARATION}: {exc}")
    base = data.get("base_model") if isinstance(data, dict) else None
    return str(base) if base else None


class AdapterCache:
    """The adapters loaded into one warm model, least recently used first.

    ``load(name, folder)`` puts an adapter into the model; ``unload(name)`` takes it out.
    ``prepare(requests)`` makes every adapter of a job loaded (loading what is missing,
    evicting the least recently used ones that this job does not need beyond
    ``capacity``) and returns their folders; it never reloads the base model. ``loads``
    counts adapter loads from disk (a cache hit costs none).
    """

    def __init__(self, roots: list[Path], family: str, load: Callable[[str, Path], None],
                 unload: Callable[[str], None], capacity: int = DEFAULT_CACHE_SIZE):
        if capacity < MAX_ADAPTERS_PER_JOB:
            raise ValueError(f"capacity must be at least {MAX_ADAPTERS_PER_JOB}")
        self.roots, self.family = [Path(r) for r in roots], family
        self._load, self._unload, self.capacity = load, unload, capacity
        self.loaded: OrderedDict[str, Path] = OrderedDict()
        self.loads = 0

    def available(self) -> list[str]:
        return sorted({p.name for root in self.roots if root.is_dir() for p in root.iterdir()
                       if p.is_dir() and not p.name.startswith(".") and _NAME.fullmatch(p.name)})

    def folder_of(self, name: str) -> Path:
        folder = next((r / name for r in self.roots if (r / name).is_dir()), None)
        if folder is None:
            have = self.available()
            listing = (f"available: {', '.join(have)}" if have
                       else f"this provider has none (they go in {self.roots[0]}/<name>/)")
            raise BadInput(f"adapters: no {self.family} adapter {name!r}; {listing}")
        base = declared_base(folder)
        if base is not None and base != self.family:
            raise BadInput(f"adapters: {name!r} is an adapter for {base}, not for {self.family}; "
                           f"choose a {self.family} adapter")
        return folder

    def prepare(self, requests: list[AdapterRequest]) -> None:
        folders = {r.name: self.folder_of(r.name) for r in requests}  # all checked first
        wanted = set(folders)
        for name, folder in folders.items():
            if name in self.loaded:
                self.loaded.move_to_end(name)
                continue
            while len(self.loaded) >= self.capacity:
                victim = next(n for n in self.loaded if n not in wanted)
                del self.loaded[victim]
                self._unload(victim)
            try:
                self._load(name, folder)
            except BadInput:
                self._discard(name)
                raise
            except (OSError, MemoryError) as exc:  # the machine, not the client's choice
                self._discard(name)
                raise PluginError(f"adapters: could not load {name!r}: {type(exc).__name__}: "
                                  f"{_short(exc)}", code="adapter_load_failed") from exc
            except RuntimeError as exc:
                self._discard(name)
                if "out of memory" in str(exc).lower():  # CUDA OOM: another GPU may fit it
                    raise PluginError(f"adapters: out of memory loading {name!r}",
                                      code="out_of_memory") from exc
                raise BadInput(f"adapters: {name!r} does not fit this {self.family} model "
                               f"({type(exc).__name__}: {_short(exc)}); is it an adapter for "
                               f"another base model?") from exc
            except Exception as exc:  # noqa: BLE001 - the libraries raise many kinds
                self._discard(name)
                raise BadInput(f"adapters: {name!r} does not fit this {self.family} model "
                               f"({type(exc).__name__}: {_short(exc)}); is it an adapter for "
                               f"another base model?") from exc
            self.loads += 1
            self.loaded[name] = folder

    def _discard(self, name: str) -> None:
        """Take out whatever a failed load left behind, so the model is as before."""
        try:
            self._unload(name)
        except Exception:  # noqa: BLE001 - nothing was loaded: nothing to remove
            pass


def _short(exc: Exception, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + "…"
