"""What each connected agent holds warm.

Agents report it in their capabilities (``PluginCapability.warm``: a plugin host has the
model loaded; ``Capabilities.adapters``, field 30: the registry adapters installed on disk)
and again whenever it changes (``AgentMessage.inventory``, field 30). The gateway feeds
:meth:`WarmIndex.update`; a disconnect calls :meth:`forget`.

**What reads it** (both wired in broker/services.py):

* the market's cold-start term: the ``market.warm(provider_id, plugin)`` hook is
  :meth:`WarmIndex.is_warm` — whether the provider's plugin host has the model loaded (a
  provider with no report, or a plugin it did not report, counts as warm);
* the dispatcher's placement: ``dispatcher.needs_download`` is :meth:`needs_download`,
  which reads the installed adapters, so providers that hold a job's adapters are
  preferred.

Nothing here changes prices.
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
    def __init__(self):
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

    def is_warm(self, provider_id: str, plugin: str) -> bool:
        """Whether the provider's plugin host has ``plugin``'s model loaded; a provider
        that reported nothing, or nothing about ``plugin``, counts as warm. One look under
        the lock, so a concurrent :meth:`forget` cannot fail it."""
        with self._lock:
            h = self._by_provider.get(provider_id)
            return h is None or h.plugins.get(plugin, True)

    def needs_download(self, provider_id: str, job) -> bool:
        """Whether ``provider_id`` lacks an adapter ``job`` names that it reported none of
        (the dispatcher prefers providers that need no download). Unknown providers and
        jobs without adapters need nothing."""
        names = adapter_names((getattr(job, "inputs", None) or {}).get("adapters"))
        h = self.holdings(provider_id)
        if not names or h is None:
            return False
        return any((job.plugin, n) not in h.adapters for n in names)
