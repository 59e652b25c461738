"""What the weights of the connected providers give inputs the plugin lets the weights set.

A manifest may declare an input ``default_from = "weights"`` (sdk.protocol.schema): its
natural default is a property of the model, not of the plugin. The image size is the case
in point: diffusers defaults to the UNet's sample size times the VAE's scale factor, 512×512
for SD 1.5 and 64×64 for the tiny weights the demo runs, where 512×512 would take half an
hour a picture on a CPU. Each agent reports what its weights give, per plugin
(``PluginCapability.input_defaults``, from the plugin host's ``Plugin.input_defaults()``);
the gateway feeds :meth:`WeightsDefaults.update` at connect and :meth:`forget` at
disconnect.

The job service asks :meth:`for_job` at submit, before it prices the job, and fills the
answer into the inputs the client left out, so a job's inputs, its work units and its
price are explicit from then on and every provider (and every check run) runs the same
size. The answer is, per such input, the value on which every online provider that could
run the job agrees: those serving the build, with the weights the job is pinned to
(``broker.market.builds.pinned_digest``), any weights when it is pinned to none. A
provider that reported nothing for an input counts as giving the manifest's default; when
the providers disagree, or none is online, the manifest's default stands. A client that
wants a size names it; one that wants a given model pins ``weights_digest``.

A report is checked against the catalog's manifest (only inputs declared so, only values
the schema accepts); one that fails is logged and counts as no report. Like the market's
view of providers, this is the view of the agents connected to this broker process, and,
with replicas, of those other replicas hold (read from the providers' stored records).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from broker.catalog.registry import PluginCatalog
from broker.errors import UnknownPlugin
from broker.market.builds import ANY_WEIGHTS, pinned_digest
from sdk.protocol.manifest import Manifest
from sdk.protocol.schema import InputError

log = logging.getLogger(__name__)

#: A report longer than this (characters of JSON) is refused unread: a few numbers are all
#: it ever holds.
MAX_REPORT_CHARS = 4096


class WeightsDefaults:
    """Thread-safe; one per broker process (see the module docstring)."""

    def __init__(self, catalog: PluginCatalog,
                 elsewhere: Callable[[], dict[str, list[dict]]] | None = None, *,
                 ttl_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        """``elsewhere()``: provider id -> the plugins it advertised (as stored, with
        ``input_defaults``) of the providers other broker replicas hold now; their
        reports count as this process's agents' do, so a submit fills in the same size on
        every replica (read at most every ``ttl_s``). None: this process only."""
        self.catalog = catalog
        self.elsewhere = elsewhere
        self.ttl_s = ttl_s
        self.clock = clock
        self._remote: dict[str, dict[tuple[str, str], tuple[str, dict]]] = {}
        self._remote_at = float("-inf")
        self._lock = threading.Lock()
        # provider id -> (session token, {(plugin, version): (weights digest, defaults)})
        self._by_provider: dict[str, tuple[object, dict[tuple[str, str], tuple[str, dict]]]] = {}
        self._answers: dict[tuple[str, str, str], dict[str, Any]] = {}

    # ---- what the agents report -------------------------------------------------------
    def update(self, provider_id: str, plugins: list[dict], session: object = None) -> None:
        """The provider connected (``session``: a token of this connection) serving
        ``plugins`` [{name, version, weights_digest, input_defaults}], ``input_defaults``
        a JSON object as the agent sent it ("" or absent: none)."""
        served = {}
        for p in plugins:
            key = (p["name"], p["version"])
            served[key] = (p.get("weights_digest") or "",
                           self._checked(provider_id, key, p.get("input_defaults")))
        with self._lock:
            self._by_provider[provider_id] = (session, served)
            self._answers.clear()

    def forget(self, provider_id: str, session: object = None) -> None:
        """The provider's connection ``session`` closed. A newer connection of the same
        provider (an agent that reconnected before its old stream closed) stays."""
        with self._lock:
            held = self._by_provider.get(provider_id)
            if held is not None and held[0] is session:
                del self._by_provider[provider_id]
                self._answers.clear()

    def _checked(self, provider_id: str, key: tuple[str, str], raw: Any) -> dict:
        if not raw:
            return {}
        try:
            if isinstance(raw, str):
                if len(raw) > MAX_REPORT_CHARS:
                    raise InputError("", f"the report is {len(raw):,} characters long; at "
                                         f"most {MAX_REPORT_CHARS:,} are read")
                raw = json.loads(raw)
            return self.catalog.get(*key).inputs.weights_defaults(raw)
        except (InputError, ValueError, RecursionError, UnknownPlugin) as exc:
            log.warning("provider %s reports input defaults for %s@%s that are refused (%s); "
                        "the manifest's defaults apply to its jobs", provider_id, *key, exc)
            return {}

    # ---- what a job gets --------------------------------------------------------------
    def for_job(self, manifest: Manifest, weights_digest: str | None = None) -> dict[str, Any]:
        """The values to fill into a job of ``manifest``'s build (pinned to
        ``weights_digest``, if any) for the inputs declared ``default_from = "weights"``
        that the providers who could run it agree on, where that differs from the
        manifest's default. {} when nothing is to change."""
        names = manifest.inputs.weights_default_names
        if not names:
            return {}
        pin = pinned_digest(manifest, weights_digest)
        key = (manifest.name, manifest.version, pin)
        self._read_elsewhere()
        with self._lock:
            answer = self._answers.get(key)
            if answer is None:
                answer = self._answers[key] = self._agreed(manifest, names, pin)
        return dict(answer)

    def _read_elsewhere(self) -> None:
        """Refresh the reports of the providers other replicas hold (every ``ttl_s``)."""
        if self.elsewhere is None or self.clock() - self._remote_at < self.ttl_s:
            return
        try:
            held = self.elsewhere()
        except Exception:  # noqa: BLE001 - the last reports read stand until the next try
            log.exception("could not read the providers other replicas hold")
            held = None
        remote = None
        if held is not None:
            remote = {pid: {(p["name"], str(p.get("version", ""))):
                            (p.get("weights_digest") or "",
                             self._checked(pid, (p["name"], str(p.get("version", ""))),
                                           p.get("input_defaults")))
                            for p in plugins if isinstance(p, dict) and "name" in p}
                      for pid, plugins in held.items()}
        with self._lock:
            self._remote_at = self.clock()
            if remote is not None and remote != self._remote:
                self._remote = remote
                self._answers.clear()

    def _agreed(self, manifest: Manifest, names: list[str], pin: str) -> dict[str, Any]:
        build = (manifest.name, manifest.version)
        served_by = [served for _, served in self._by_provider.values()]
        served_by += [served for pid, served in self._remote.items()
                      if pid not in self._by_provider]
        reports = [defaults for served in served_by
                   for (digest, defaults) in [served.get(build, (None, None))]
                   if defaults is not None and (pin == ANY_WEIGHTS or digest == pin)]
        declared = {f.name: f.default for f in manifest.inputs.fields}
        out = {}
        for name in names:
            values = {r.get(name, declared[name]) for r in reports}
            if len(values) == 1:
                value = values.pop()
                if value != declared[name]:
                    out[name] = value
        return out
