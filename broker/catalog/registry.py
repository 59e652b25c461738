"""PluginCatalog: the plugins the broker accepts jobs for, read from plugin.toml files."""
from __future__ import annotations

import logging
from pathlib import Path

from sdk.protocol.manifest import Manifest, ManifestError, load_manifest, version_key
from broker.errors import UnknownPlugin

log = logging.getLogger(__name__)


class PluginCatalog:
    def __init__(self, manifests: list[Manifest] | None = None):
        self._by_name: dict[str, dict[str, Manifest]] = {}
        for m in manifests or []:
            self.add(m)

    @classmethod
    def from_folders(cls, roots: list[Path]) -> "PluginCatalog":
        """Every ``*/plugin.toml`` under ``roots``; malformed manifests are logged and skipped."""
        catalog = cls()
        for root in roots:
            for toml in sorted(Path(root).glob("*/plugin.toml")):
                try:
                    catalog.add(load_manifest(toml.parent))
                except ManifestError as exc:
                    log.error("skipping plugin: %s", exc)
        return catalog

    def add(self, manifest: Manifest) -> None:
        self._by_name.setdefault(manifest.name, {})[manifest.version] = manifest

    def get(self, name: str, version: str | None = None) -> Manifest:
        versions = self._by_name.get(name)
        if not versions:
            raise UnknownPlugin(f"unknown plugin {name!r}; available: {self.names()}",
                                field="plugin")
        if version is None:
            return versions[max(versions, key=version_key)]
        if version not in versions:
            raise UnknownPlugin(f"plugin {name!r} has no version {version!r}; versions: "
                                f"{sorted(versions, key=version_key)}", field="version")
        return versions[version]

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def all(self) -> list[Manifest]:
        return [self.get(n) for n in self.names()]
