"""The reproducibility class a run is judged by, fixed when the broker hands the run out
(issue #20, DESIGN §6).

An agent declares, per plugin build, its host's hardware class and dtype when it connects;
verification judges a run by that class (latent hashes within one class, structure across
classes) and counts the check towards the provider's standing in it. Read back at judging
time from the provider's record, the class was whatever the machine declared *last*: a
provider could run a job under one class and reconnect declaring another before its check
was judged. So the class its session declared is recorded in the envelope of each run at
assignment (``repro_class``: ``{"hardware_class", "dtype"}``), a job's as a check's or a
canary's (every envelope carries it, so it tells no job from another), and judging reads it
from there: the envelope is the broker's copy, signed by it, which no later message of the
agent changes.
"""
from __future__ import annotations

#: The envelope field that records the class (its weights are the envelope's
#: ``weights_digest``).
ENVELOPE_FIELD = "repro_class"


def declared_class(target, plugin: str, version: str) -> dict[str, str]:
    """What the connected agent ``target`` (a dispatcher session: ``classes`` maps
    ``name@version`` to its declaration) declared at connect for ``plugin@version``; ""
    for a part it declared none (a class of its own when judged)."""
    declared = (getattr(target, "classes", None) or {}).get(f"{plugin}@{version}") or {}
    return {"hardware_class": str(declared.get("hardware_class") or "")[:120],
            "dtype": str(declared.get("dtype") or "")[:40]}


def recorded_class(envelope: dict | None) -> dict[str, str] | None:
    """The class recorded in ``envelope`` when its run was assigned; None for an envelope
    written before the broker recorded one (or no envelope)."""
    recorded = (envelope or {}).get(ENVELOPE_FIELD)
    if not isinstance(recorded, dict):
        return None
    return {"hardware_class": str(recorded.get("hardware_class") or ""),
            "dtype": str(recorded.get("dtype") or "")}
