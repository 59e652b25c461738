"""What each connected agent holds warm, so placement can prefer agents that need no
download or load.

Agents report it in their capabilities (``PluginCapability.warm``: a plugin host has the
model loaded; ``Capabilities.adapters``, field 30: the registry adapters installed on disk)
and again whenever it changes (``AgentMessage.inventory``, field 30). The gateway feeds
:meth:`WarmIndex.update`; a disconnect calls :meth:`forget`.

**The hook** for the market's scoring (owned by the auction): :meth:`WarmIndex.cold_cost`
says what a provider lacks for a job — 0 when it has the plugin warm and every published
adapter the job names installed; otherwise a count of the misses (a cold plugin host, each
adapter to download) — and :meth:`WarmIndex.penalty_s` turns that into seconds to add to
the expected completion time (a small preference: one download/load ≈ ``per_miss_s``).
:meth:`WarmIndex.prefer` orders a list of provider ids warm-first (stable otherwise), for
a dispatcher that picks among equals. Nothing here changes prices.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from sdk.protocol.package import adapter_names


@dataclass
class Holdings:
    plugins: dict[str, bool] = field(default_factory=dict)            # plugin -> warm
    adapters: dict[tuple[str, str], str] = field(default_factory=dict)  # (plugin, name) -> version


class WarmIndex:
    def __init__(self, registry=None, per_miss_s: float = 2.0):
        self.registry = registry   # RegistryService: which adapter names are published
        self.per_miss_s = per_miss_s
        self._by_provider: dict[str, Holdings] = {}
        self._lock = threading.Lock()

    def update(self, provider_id: str, plugins: list[dict], adapters: list[dict]) -> None:
        """Replace what ``provider_id`` holds: ``plugins`` [{name, warm}], ``adapters``
        [{plugin, name, version}]."""
        h = Holdings({p["name"]: bool(p.get("warm")) for p in plugins},
                     {(a["plugin"], a["name"]): a.get("version", "") for a in adapters})
        with self._lock:
            self._by_provider[provider_id] = h

    def forget(self, provider_id: str) -> None:
        with self._lock:
            self._by_provider.pop(provider_id, None)

    def holdings(self, provider_id: str) -> Holdings | None:
        with self._lock:
            return self._by_provider.get(provider_id)

    def facts(self, provider_id: str) -> dict:
        """The ``warm`` fact of a provider, as JSON (admin views, debugging)."""
        h = self.holdings(provider_id)
        if h is None:
            return {"plugins": {}, "adapters": []}
        return {"plugins": dict(h.plugins),
                "adapters": [{"plugin": p, "name": n, "version": v}
                             for (p, n), v in sorted(h.adapters.items())]}

    def cold_cost(self, provider_id: str, plugin: str, inputs: dict | None = None) -> int:
        """0 when ``provider_id`` can start the job at once; else the number of misses."""
        h = self.holdings(provider_id)
        if h is None:
            return 1 + len(self._published(plugin, inputs))
        misses = 0 if h.plugins.get(plugin) else 1
        for name, version in self._published(plugin, inputs):
            if h.adapters.get((plugin, name)) != version:
                misses += 1
        return misses

    def penalty_s(self, provider_id: str, plugin: str, inputs: dict | None = None) -> float:
        return self.per_miss_s * self.cold_cost(provider_id, plugin, inputs)

    def prefer(self, provider_ids: list[str], plugin: str, inputs: dict | None = None) -> list[str]:
        return sorted(provider_ids, key=lambda p: self.cold_cost(p, plugin, inputs))

    def _published(self, plugin: str, inputs: dict | None) -> list[tuple[str, str]]:
        """(name, latest version) of the published adapters the job names."""
        if self.registry is None:
            return [(n, "") for n in adapter_names((inputs or {}).get("adapters"))]
        return [(r.adapter, r.version) for r in self.registry.royalties_for(plugin, inputs)]
