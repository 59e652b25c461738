"""A job's ``adapters`` input (LoRA adapters and their scales), read the same way by the
broker (its input rules, the registry's royalties and placement), the agent (what to
install) and the plugins (what to load): ``"ink:0.8, film"`` or ``'{"ink": 0.8}'``.

Only the standard library: sdk.protocol.schema's rules import this module."""
from __future__ import annotations

import json
import math
import re
from typing import Any

# An adapter name in a job's ``adapters`` input (plugins.adapters checks it with fullmatch).
ADAPTER_INPUT_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
MAX_ADAPTERS_PER_JOB = 4
ADAPTER_SCALE_LIMITS = (-4.0, 4.0)


def check_adapters(text: str | None) -> list[tuple[str, float]]:
    """A job's ``adapters`` input checked strictly, as (name, scale) pairs in name order;
    [] for "" or None. Raises ValueError saying what is wrong and what is allowed: names
    of letters, digits, '.', '_' and '-'; scales numbers from -4 to 4; each name once; at
    most MAX_ADAPTERS_PER_JOB. The one check: plugins.adapters.parse_adapters (a plugin
    host) and the broker's input rules (``adapter_count(...)``, at submit) both call it.

    Name order, not the order given: the LoRA deltas are summed in list order and float
    sums depend on order, so "ink,film" and "film,ink" must reach the model the same way."""
    try:
        pairs = adapter_pairs(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"adapters is not valid JSON ({exc.msg} at character {exc.pos}); "
                         f'send {{"name": scale}} or "name:scale,name2:scale"') from None
    out: dict[str, float] = {}
    for name, raw in pairs:
        if not isinstance(name, str) or not ADAPTER_INPUT_NAME_RE.fullmatch(name):
            raise ValueError(f"adapters: {name!r} is not an adapter name (letters, digits, "
                             "'.', '_' and '-', starting with a letter or digit); write "
                             '"name:scale,name2:scale", e.g. "ink:0.8"')
        if name in out:
            raise ValueError(f"adapters: {name!r} is given twice; give each adapter once")
        out[name] = _adapter_scale(name, raw)
    if len(out) > MAX_ADAPTERS_PER_JOB:
        raise ValueError(f"adapters: {len(out)} adapters given; at most "
                         f"{MAX_ADAPTERS_PER_JOB} per job")
    return sorted(out.items())


def _adapter_scale(name: str, raw: Any) -> float:
    lo, hi = ADAPTER_SCALE_LIMITS
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
        raise ValueError(f"adapters: the scale of {name!r} is {raw!r}; give a number")
    try:
        scale = float(raw)
    except ValueError:
        raise ValueError(f"adapters: the scale of {name!r} is {raw!r}; give a number, as in "
                         f'"{name}:0.8" (adapters are named without a version: the latest '
                         "published one for the job's plugin is used)") from None
    if not math.isfinite(scale) or not lo <= scale <= hi:
        raise ValueError(f"adapters: the scale of {name!r} is {raw!r}; it must be between "
                         f"{lo:g} and {hi:g}")
    return scale


def adapter_pairs(text: str | None) -> list[tuple[Any, Any]]:
    """A job's ``adapters`` input split into (name, raw scale) pairs, unchecked:
    ``"ink:0.8, film"`` gives ``[("ink", "0.8"), ("film", 1.0)]`` and ``'{"ink": 0.8}'``
    gives ``[("ink", 0.8)]``; "" or None gives []. Raises json.JSONDecodeError for bad
    JSON and ValueError for JSON that is not an object. plugins.adapters.parse_adapters
    checks the pairs strictly; :func:`adapter_names` leaves out what it would refuse."""
    text = (text or "").strip()
    if not text:
        return []
    if text.startswith("{"):
        table = json.loads(text)
        if not isinstance(table, dict):
            raise ValueError('adapters as JSON must be an object like {"ink": 0.8}')
        return list(table.items())
    pairs: list[tuple[Any, Any]] = []
    for part in text.split(","):
        name, sep, scale = part.strip().partition(":")
        pairs.append((name.strip(), scale.strip() if sep else 1.0))
    return pairs


def adapter_names(value: Any) -> list[str]:
    """The adapter names a job's ``adapters`` input asks for (``"ink:0.8,film"`` or
    ``{"ink": 0.8}``), leniently: whatever the plugin would refuse is left out."""
    if not isinstance(value, str):
        return []
    try:
        pairs = adapter_pairs(value)
    except ValueError:
        return []
    out: list[str] = []
    for name, _ in pairs:
        if isinstance(name, str) and ADAPTER_INPUT_NAME_RE.fullmatch(name) and name not in out:
            out.append(name)
    return out
